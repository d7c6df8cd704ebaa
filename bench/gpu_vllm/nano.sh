# nano.sh MODEL_DIR [ISLS] -- job: Nemotron-3-Nano-30B-A3B with --load-format dummy, P and D on GPU 0 through
# hybridpd serve; plan, `hybridpd verify --prefill` at every length, then the repeated sweep (vLLM's times).
R=$JOBDIR; L=$R/logs; mkdir -p "$L"
M=${1:?model dir}; ISLS=${2:-1000,2000,4000,8000,16000,32000}; KV=${NANO_KV:-2GiB}
. bench/gpu_vllm/serve_lib.sh
V=$(python3 -c "import importlib.metadata as m; print(m.version('vllm'))")
COMMON=(--vllm-version "$V" --no-enable-prefix-caching --kv-cache-memory "$KV" --max-model-len 32768)
python3 -m hybridpd_cli.main plan "$M" "${COMMON[@]}" --platform cuda --isl "$ISLS" --json > "$L/plan.json" 2> "$L/plan.err"
serve_pd "$L" nano 8000 560 "$M" "${COMMON[@]}" --gpu-memory-utilization 0.1 -- --enforce-eager --seed 0 \
  --max-num-seqs 4 --load-format dummy ${NANO_VLLM_ARGS:-} || { stop_pd; keylines "$L/nano.serve.err" > "$L/nano.keylines.txt"; exit 4; }
for n in ${ISLS//,/ }; do
  python3 -m hybridpd_cli.main verify "$M" "${COMMON[@]}" --platform cuda --decode "$D_URL" --prefill "$P_URL" \
    --prompt-tokens --isl "$n" --json > "$L/verify-$n.json" 2> "$L/verify-$n.err"; echo "verify isl $n rc=$?"
done
python3 bench/gpu_vllm/sweep.py --decode "$D_URL" --prefill "$P_URL" --isls "$ISLS" --repeats "${NANO_REPEATS:-5}" \
  --out "$L/sweep.json" > "$L/sweep.log" 2>&1; echo "sweep rc=$?"
stop_pd
keylines "$L/nano.serve.err" > "$L/nano.keylines.txt"
