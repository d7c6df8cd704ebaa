# serve_lib.sh -- sourced by the job scripts: start `hybridpd serve --role all` in the background and wait.
#   serve_pd LOGDIR TAG PORTBASE TIMEOUT_S MODEL [serve options...] -- [vllm args...]
#   P on PORTBASE+100, D on PORTBASE+200, proxy on PORTBASE, side channels PORTBASE-2400 (+1)
#   P and D share GPU 0: serve gets two ids and CUDA_VISIBLE_DEVICES=0 for both.
serve_pd() {
  local logs=$1 tag=$2 base=$3 tmo=$4 model=$5; shift 5
  P_URL=http://127.0.0.1:$((base + 100)); D_URL=http://127.0.0.1:$((base + 200)); X_URL=http://127.0.0.1:$base
  local cmd=(python3 -m hybridpd_cli.main serve "$model" --platform cuda --gpus 0-1 --env CUDA_VISIBLE_DEVICES=0
             --vllm-command "python3 -m vllm.entrypoints.cli.main" --prefill-port $((base + 100))
             --decode-port $((base + 200)) --proxy-port "$base" --side-channel-port $((base - 2400)) "$@")
  printf '%q ' "${cmd[@]}" > "$logs/$tag.serve.cmd"; echo >> "$logs/$tag.serve.cmd"
  setsid "${cmd[@]}" > "$logs/$tag.serve.out" 2> "$logs/$tag.serve.err" < /dev/null &
  SERVE_PID=$!
  local t0; t0=$(date +%s)
  until grep -q "all healthy" "$logs/$tag.serve.err" 2>/dev/null; do
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo "serve $tag died"; tail -30 "$logs/$tag.serve.err"; return 1; fi
    if [ $(( $(date +%s) - t0 )) -gt "$tmo" ]; then echo "serve $tag not healthy in $tmo s"; tail -30 "$logs/$tag.serve.err"; return 1; fi
    sleep 2
  done
  echo "[$(date +%T)] $tag healthy after $(( $(date +%s) - t0 )) s"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee "$logs/$tag.gpu_mem.txt"
}
stop_pd() {  # TERM the supervisor (it stops its children), then KILL its session
  kill -TERM "$SERVE_PID" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null; true
}
# engine log lines worth keeping (block sizes, padding, HMA, transfer plan, attention backend, UCX transport)
keylines() {
  grep -h -E 'attention block size|Padding mamba|block size|Hybrid|hybrid kv cache|GPU KV cache size|Maximum concurrency|FlashAttention|Attention backend|Using .* backend|compatibility|NIXL is|Backend UCX|Model loading took|Error|Traceback|zero-copy|descriptors|num_blocks|KV cache' "$@" | cut -c1-500
}
