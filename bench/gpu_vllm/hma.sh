# hma.sh PORT -- job: does vLLM keep the hybrid KV cache manager on with the NixlConnector when
# --no-disable-hybrid-kv-cache-manager is NOT given?  One plain server (tiny NemotronH), its log kept.
R=$JOBDIR; L=$R/logs; mkdir -p "$L"; port=${1:-9500}
M=$R/nemotronh; python3 "$HYBRIDPD_VLLM_EXAMPLES/make_hybrid.py" nemotronh "$M" --weights > "$L/make_model.txt" 2>&1 || exit 3
CMD=(python3 -m vllm.entrypoints.openai.api_server --model "$M" --host 127.0.0.1 --port "$port" --seed 0
     --gpu-memory-utilization 0.1 --kv-cache-memory-bytes 1073741824 --max-model-len 512 --enforce-eager
     --no-enable-prefix-caching --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
echo "${CMD[*]}" > "$L/hma.cmd"
VLLM_NIXL_SIDE_CHANNEL_PORT=$((port - 3000)) setsid "${CMD[@]}" > "$L/hma.log" 2>&1 < /dev/null & pid=$!
ok=0
for _ in $(seq 240); do
  kill -0 $pid 2>/dev/null || break
  curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && { ok=1; break; }
  sleep 2
done
echo "healthy=$ok"
if [ $ok = 1 ]; then
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$M\",\"prompt\":[5,6,7,8,9,10,11,12,13,14],\"max_tokens\":4,\"temperature\":0}" > "$L/hma_completion.json"
  echo "completion: $(head -c 300 "$L/hma_completion.json")"
fi
kill -TERM -- -$pid 2>/dev/null; sleep 5; kill -KILL -- -$pid 2>/dev/null
grep -n -i -E "hybrid kv cache|HMA|Turning off|unified type|disable_hybrid|Error" "$L/hma.log" | cut -c1-400 | tee "$L/hma_grep.txt"
