# tiny_sweep.sh PORTBASE -- job: tiny NemotronH P/D via hybridpd serve, vLLM's transfer times at 100..1000 tokens.
R=$JOBDIR; L=$R/logs; mkdir -p "$L"; base=${1:-9000}
. bench/gpu_vllm/serve_lib.sh
V=$(python3 -c "import importlib.metadata as m; print(m.version('vllm'))")
M=$R/nemotronh; python3 "$HYBRIDPD_VLLM_EXAMPLES/make_hybrid.py" nemotronh "$M" --weights > "$L/make_model.txt" 2>&1 || exit 3
python3 - "$M/config.json" <<'PY'
import json, sys; p = sys.argv[1]; c = json.load(open(p)); c["max_position_embeddings"] = 4096; json.dump(c, open(p, "w"))
PY
COMMON=(--vllm-version "$V" --no-enable-prefix-caching --kv-cache-memory 1GiB --max-model-len 2048)
serve_pd "$L" tiny "$base" 480 "$M" "${COMMON[@]}" --gpu-memory-utilization 0.1 -- --enforce-eager --seed 0 --max-num-seqs 16 || { stop_pd; exit 4; }
python3 -m hybridpd_cli.main plan "$M" "${COMMON[@]}" --platform cuda --isl 100,200,500,1000,2000 --json > "$L/plan.json" 2> "$L/plan.err"
python3 bench/gpu_vllm/sweep.py --decode "$D_URL" --prefill "$P_URL" --isls 100,200,500,1000,2000 --repeats 7 --warmup 100 --out "$L/sweep.json" > "$L/sweep.log" 2>&1; echo "sweep rc=$?"
stop_pd
keylines "$L/tiny.serve.err" > "$L/tiny.keylines.txt"
tail -3 "$L/sweep.log"
