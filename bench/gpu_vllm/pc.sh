#!/bin/bash
# pc.sh CMD ... -- device side of the 2026-12-02 H200 runs (issue #32 item 5, issue #30 item 3). Runs in the repo
# root of a `run` call; this folder is carried as build/gpu (git-ignored) beside the payload pieces build/gvpK.
#
#   take DIR...        copy the carried piece(s) DIR/p* to $H/pieces, check them against SHA256SUMS beside this
#                      script; exit 4 when an earlier piece is gone (a fresh machine: start again from p1)
#   unpack             check all pieces, extract pack.tgz to $H/pack (site/ = vLLM 0.26.0 + deps + slim NIXL),
#                      and snapshot this folder to $H/gpu (later calls replace the work tree)
#   bg JOB SCRIPT ARGS run `bash $H/gpu/SCRIPT ARGS` in a new session (it outlives the call) with env.sh;
#                      log, rc, pid in $H/runs/JOB/ (JOBDIR)
#   status             every job: running or rc, and its log tail; GPU memory
#   stop JOB           TERM then KILL the job's process group
#   collect            the small files of $H/runs into $OUT/runs.tgz (no weights, no payload)
# H=/tmp/h26
set -u
H=/tmp/h26
HERE=$(cd "$(dirname "$0")" && pwd)
cmd=${1:?usage: pc.sh take|unpack|bg|status|stop|collect}; shift
mkdir -p "$H/runs" "$H/pieces"
case $cmd in
take)
  rc=0
  for d in "$@"; do
    for f in "$d"/p*; do
      cp "$f" "$H/pieces/" || rc=3
      b=$(basename "$f")
      if (cd "$H/pieces" && grep " $b\$" "$HERE/SHA256SUMS" | sha256sum -c --quiet -); then echo "piece $b ok"
      else echo "piece $b BAD"; rc=3; fi
    done
  done
  for b in $(awk '{print $2}' "$HERE/SHA256SUMS"); do [ -f "$H/pieces/$b" ] && echo "have $b" || echo "missing $b"; done
  first=$(awk '{print $2}' "$HERE/SHA256SUMS" | sort -V | head -1)
  [ -f "$H/pieces/$first" ] || { echo "an earlier piece is gone: fresh machine"; rc=4; }
  exit $rc ;;
unpack)
  rm -rf "$H/gpu"; cp -r "$HERE" "$H/gpu"
  mkdir -p "$H/shim"; rm -rf "$H/shim/hybridpd_cli" "$H/hpd"; mkdir -p "$H/hpd"
  # this call's checkout as hybridpd (cli/ also under its import name hybridpd_cli)
  cp -r hybridpd "$H/hpd/hybridpd"; cp -r cli "$H/shim/hybridpd_cli"
  [ -d "$H/pack/site/vllm" ] && { echo "already unpacked"; exit 0; }
  (cd "$H/pieces" && sha256sum -c --quiet "$HERE/SHA256SUMS") || { echo "pieces bad/missing"; exit 3; }
  t=$(date +%s)
  (cd "$H/pieces" && cat $(awk '{print $2}' "$HERE/SHA256SUMS" | sort -V)) | tar xzf - -C "$H" || exit 3
  echo "unpacked $(du -sh "$H/pack" | cut -f1) in $(( $(date +%s) - t )) s" ;;
bg)
  JOB=$1; shift
  R=$H/runs/$JOB; rm -rf "$R"; mkdir -p "$R"
  setsid nohup bash -c 'export JOBDIR="$0"; cd "$0" && . /tmp/h26/gpu/env.sh && bash /tmp/h26/gpu/"$@"; echo $? > "$0/rc"' \
    "$R" "$@" > "$R/log" 2>&1 < /dev/null &
  echo $! > "$R/pid"; echo "started $JOB pid $(cat "$R/pid"): $*" ;;
status)
  for R in "$H"/runs/*/; do
    j=$(basename "$R")
    if [ -f "$R/rc" ]; then echo "== $j: done rc=$(cat "$R/rc")"; else echo "== $j: running"; fi
    tail -n "${TAIL:-4}" "$R/log" 2>/dev/null | cut -c1-300
  done
  nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader ;;
stop)
  R=$H/runs/$1; p=$(cat "$R/pid"); kill -TERM -- "-$p" 2>/dev/null; sleep 5; kill -KILL -- "-$p" 2>/dev/null
  echo "stopped $1 (group $p)" ;;
collect)
  O=${OUT:-$H/out}; mkdir -p "$O"
  (cd "$H" && tar czf "$O/runs.tgz" --exclude='*.safetensors' runs 2>/dev/null)
  ls -la "$O" ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
