#!/bin/bash
# device.sh CMD ... -- the device side of the GPU runs (issue #22); runs in the repo root of a `run` call.
#
#   take V DIR...      copy the carried piece(s) DIR/p* of payload V (24|26) to $H/V/pieces, check sha256
#                      against .gvs/sums-V.txt; exit 4 when an earlier piece is gone (a fresh machine)
#   unpack V           check all pieces of V and extract pack.tgz to $H/V/pack (site/ = vLLM + deps)
#   probe              machine facts
#   bg JOB V SCRIPT [ARGS]  snapshot this repo to $H/repo-JOB and run `bash SCRIPT ARGS` there in a new session
#                      (it outlives the call) with env.sh V sourced; log/rc/pid in $H/runs/JOB/
#   status             every job: running or rc, and its log tail; GPU memory
#   stop JOB           TERM then KILL the job's process group
#   collect            small files of $H/runs into $OUT (runs.tgz + *.txt/json summaries)
# H=/tmp/hpd. Payload pieces: built by ../shared/reference/gpu-vllm/build_payload.sh (see README.md here).
set -u
H=/tmp/hpd
REPO=$(pwd)
cmd=${1:?usage: device.sh take|unpack|probe|bg|status|stop|collect}; shift
mkdir -p "$H/runs"

case $cmd in
take)
  V=$1; shift; mkdir -p "$H/$V/pieces"; rc=0
  for d in "$@"; do
    for f in "$d"/p*; do
      cp "$f" "$H/$V/pieces/" || rc=3
      b=$(basename "$f")
      if (cd "$H/$V/pieces" && grep " $b\$" "$REPO/.gvs/sums-$V.txt" | sha256sum -c --quiet -); then
        echo "payload $V piece $b ok"
      else echo "payload $V piece $b BAD"; rc=3; fi
    done
  done
  # a fresh machine has lost the earlier pieces
  for b in $(awk '{print $2}' "$REPO/.gvs/sums-$V.txt"); do
    [ -f "$H/$V/pieces/$b" ] && echo "have $V/$b" || { echo "missing $V/$b"; }
  done
  first=$(awk '{print $2}' "$REPO/.gvs/sums-$V.txt" | sort -V | head -1)
  [ -f "$H/$V/pieces/$first" ] || { echo "an earlier piece is gone: fresh machine"; rc=4; }
  exit $rc ;;
unpack)
  V=$1
  [ -d "$H/$V/pack/site/vllm" ] && { echo "$V already unpacked"; exit 0; }
  (cd "$H/$V/pieces" && sha256sum -c --quiet "$REPO/.gvs/sums-$V.txt") || { echo "pieces of $V bad/missing"; exit 3; }
  t=$(date +%s)
  (cd "$H/$V/pieces" && cat $(awk '{print $2}' "$REPO/.gvs/sums-$V.txt" | sort -V)) | tar xzf - -C "$H/$V" || exit 3
  echo "unpacked $V: $(du -sh "$H/$V/pack" | cut -f1) in $(( $(date +%s) - t )) s" ;;
untar)  # untar SRC.tgz DST: an extra carried tree (e.g. an older transformers for vLLM 0.24's Granite)
  mkdir -p "$2" && tar xzf "$1" -C "$2" && echo "untarred $1 into $2 ($(du -sh "$2" | cut -f1))" ;;
probe)
  date; uname -srm; nproc; free -g | head -2; df -h /tmp | tail -1
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(transformers|tokenizers|triton|numpy|pytest|pytest-xdist|click|rich|aiohttp|prometheus.client|matplotlib|tabulate) " ;;
bg)
  JOB=$1 V=$2; shift 2
  R=$H/runs/$JOB; rm -rf "$R" "$H/repo-$JOB"; mkdir -p "$R"
  # a snapshot: the next call replaces the work tree under a running job
  tar --exclude='./.gv*' -cf - . | (mkdir -p "$H/repo-$JOB" && tar -C "$H/repo-$JOB" -xf -)
  [ -d .gvex ] && { mkdir -p "$H/gvex"; cp -r .gvex/. "$H/gvex/"; }
  setsid nohup bash -c 'export JOBDIR="$0"; cd "$1" && . bench/gpu_vllm/env.sh "$2" && shift 3 && bash "$@"; echo $? > "$0/rc"' \
    "$R" "$H/repo-$JOB" "$V" x "$@" > "$R/log" 2>&1 < /dev/null &
  echo $! > "$R/pid"; echo "started $JOB (payload $V) pid $(cat "$R/pid"): $*" ;;
status)
  for R in "$H"/runs/*/; do
    j=$(basename "$R")
    if [ -f "$R/rc" ]; then echo "== $j: done rc=$(cat "$R/rc")"; else echo "== $j: running"; fi
    tail -n "${TAIL:-6}" "$R/log" 2>/dev/null | cut -c1-300
  done
  nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader ;;
stop)
  R=$H/runs/$1; p=$(cat "$R/pid"); kill -TERM -- "-$p" 2>/dev/null; sleep 5; kill -KILL -- "-$p" 2>/dev/null
  echo "stopped $1 (group $p)" ;;
collect)
  O=${OUT:-/tmp/hpd/out}; mkdir -p "$O"
  (cd "$H" && tar czf "$O/runs.tgz" --exclude='*.safetensors' --exclude='*/model*' runs 2>/dev/null)
  ls -la "$O" ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
