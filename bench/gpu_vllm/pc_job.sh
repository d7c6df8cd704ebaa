# pc_job.sh KIND MODE BASEPORT -- job (run by `pc.sh bg`): one tiny hybrid model, one P and one D on GPU 0 started
# with vLLM's own CLI (no hybridpd in between), the cold sweep + repeat probes (pc_sweep.py), then both stopped.
#   KIND  nemotronh | granite | nemotronh-mtp (NemotronH + one MTP attention layer, dummy weights)
#   MODE  default (no prefix-caching flag: 0.26.0's own default) | pc (--enable-prefix-caching)
#         | align (--enable-prefix-caching --mamba-cache-mode align) | all (... --mamba-cache-mode all)
#   P on BASEPORT+1, D on BASEPORT+2, side channels BASEPORT+11 / +12.
set -u
KIND=$1 MODE=$2 BASE=$3
R=$JOBDIR; G=/tmp/h26/gpu; M=$R/model
ISLS=${ISLS:-50,100,200,500,1000,1500,2000}
ts() { echo "[$(date +%T)] $*"; }
mk=${KIND%-mtp}
python3 "$G/make_hybrid.py" "$mk" "$M" --weights > "$R/make_model.txt" 2>&1 || { ts "make_hybrid failed"; tail "$R/make_model.txt"; exit 3; }
python3 - "$M/config.json" "$KIND" <<'PY'
import json, sys
p, kind = sys.argv[1:]
c = json.load(open(p))
c["max_position_embeddings"] = 4096          # --max-model-len 2048 needs it (recipe README section 2)
if "layer_types" in c:                        # the published Granite names (transformers 5 writes the new ones)
    c["layer_types"] = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t) for t in c["layer_types"]]
if kind.endswith("-mtp"):                     # one MTP step of one attention layer (vLLM's nemotron_h_mtp.py)
    c["num_nextn_predict_layers"] = 1
    c["mtp_hybrid_override_pattern"] = "*"
json.dump(c, open(p, "w"), indent=1)
PY
cp "$M/config.json" "$R/config.json"
ARGS=(--model "$M" --served-model-name tiny --host 127.0.0.1 --seed 0 --gpu-memory-utilization 0.05
      --kv-cache-memory-bytes 1073741824 --max-model-len 2048 --enforce-eager --max-num-seqs 16
      --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
case $MODE in
  default) ;;
  pc) ARGS+=(--enable-prefix-caching) ;;
  align|all) ARGS+=(--enable-prefix-caching --mamba-cache-mode "$MODE") ;;
  *) echo "unknown MODE $MODE"; exit 2 ;;
esac
case $KIND in *-mtp) ARGS+=(--load-format dummy --speculative-config '{"method":"mtp","num_speculative_tokens":1}') ;; esac
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y UCX_NET_DEVICES=lo
printf '%q ' python3 -m vllm.entrypoints.openai.api_server "${ARGS[@]}" > "$R/serve.cmd"; echo >> "$R/serve.cmd"
start() { # NAME PORT SIDE
  VLLM_NIXL_SIDE_CHANNEL_PORT=$3 CUDA_VISIBLE_DEVICES=0 setsid python3 -m vllm.entrypoints.openai.api_server \
    "${ARGS[@]}" --port "$2" > "$R/$1.log" 2>&1 < /dev/null &
  echo $! > "$R/$1.pid"
}
stop() {
  for n in P D; do kill -TERM -- "-$(cat "$R/$n.pid")" 2>/dev/null; done
  for _ in $(seq 20); do kill -0 "$(cat "$R/P.pid")" 2>/dev/null || kill -0 "$(cat "$R/D.pid")" 2>/dev/null || break; sleep 1; done
  for n in P D; do kill -KILL -- "-$(cat "$R/$n.pid")" 2>/dev/null; done
  grep -h -E 'attention block size|Padding mamba|[Mm]amba cache mode|[Pp]refix caching|block_size|Hybrid SSM|hybrid kv cache|GPU KV cache size|Maximum concurrency|FlashAttention|ttention backend|NIXL|Nixl|UCX|zero-copy|KV cache|speculative|[Dd]rafter|MTP|Error|error|Traceback|assert' \
    "$R/P.log" > "$R/P.keylines.txt" 2>/dev/null
  grep -h -E 'attention block size|Padding mamba|[Mm]amba cache mode|[Pp]refix caching|block_size|Hybrid SSM|hybrid kv cache|GPU KV cache size|Maximum concurrency|FlashAttention|ttention backend|NIXL|Nixl|UCX|zero-copy|KV cache|speculative|[Dd]rafter|MTP|Error|error|Traceback|assert|Transfer plan' \
    "$R/D.log" > "$R/D.keylines.txt" 2>/dev/null
}
trap stop EXIT
start P $((BASE + 1)) $((BASE + 11))
start D $((BASE + 2)) $((BASE + 12))
t0=$(date +%s)
for port in $((BASE + 1)) $((BASE + 2)); do
  until python3 -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)" "http://127.0.0.1:$port/health" 2>/dev/null; do
    for n in P D; do kill -0 "$(cat "$R/$n.pid")" 2>/dev/null || { ts "$n died"; tail -25 "$R/$n.log"; exit 4; }; done
    [ $(( $(date +%s) - t0 )) -gt "${HEALTH_S:-480}" ] && { ts "not healthy in time"; exit 5; }
    sleep 2
  done
done
ts "$KIND $MODE: P and D healthy after $(( $(date +%s) - t0 )) s"
python3 "$G/pc_sweep.py" --prefill "http://127.0.0.1:$((BASE + 1))" --decode "http://127.0.0.1:$((BASE + 2))" \
  --isls "$ISLS" --repeats "${REPEATS:-3}" --out "$R/sweep.json" > "$R/sweep.log" 2>&1
rc=$?
ts "sweep rc=$rc"; tail -6 "$R/sweep.log"
exit $rc
