# go.sh -- the last call of a lease (after the pieces are taken): unpack, the UCX bench alone on the GPU, then
# every P/D job at once (all_jobs.sh), wait for them until WAIT_S, and collect everything into $OUT/runs.tgz.
# Re-entrant: a later call runs it again and it skips what is done (WAIT_S more seconds of waiting).
set -u
G=build/gpu; T0=$(date +%s); WAIT_S=${WAIT_S:-420}
bash $G/pc.sh unpack || exit 3
if [ ! -f /tmp/h26/runs/ucx/rc ]; then
  bash $G/pc.sh bg ucx ucx.sh
  for _ in $(seq 240); do [ -f /tmp/h26/runs/ucx/rc ] && break; sleep 1; done
  grep -E '^\[[0-9]{2}:|^rc|^\{' /tmp/h26/runs/ucx/log | cut -c1-200
fi
[ -d /tmp/h26/runs/nemotronh-pc ] || bash $G/all_jobs.sh
while [ $(( $(date +%s) - T0 )) -lt "$WAIT_S" ]; do
  left=0; for j in /tmp/h26/runs/*/; do [ -f "$j/rc" ] || left=$((left + 1)); done
  [ $left = 0 ] && break; sleep 5
done
for j in /tmp/h26/runs/*/; do n=$(basename "$j"); [ "$n" = ucx ] && continue
  echo "== $n rc=$(cat "$j/rc" 2>/dev/null || echo running) | $(tail -2 "$j/log" | cut -c1-200 | tr '\n' ' ')"; done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
O=${OUT:-/tmp/h26/out}; mkdir -p "$O"
(cd /tmp/h26 && tar czf "$O/runs.tgz" --exclude='*.safetensors' --exclude='tokenizer.json' runs) && ls -la "$O"
