# ucx.sh -- job: ucx_bench.py under each UCX configuration in turn (nothing else on the GPU meanwhile).
# Every configuration also sets UCX_NET_DEVICES=lo (the machine has no other network). Output: ucx-CONFIG.jsonl
# (one line per descriptor size), ucx-CONFIG.out/.err (with UCX_PROTO_INFO=y, the protocols UCX chose; warnings).
set -u
R=$JOBDIR; G=/tmp/h26/gpu
run() { # NAME VAR=VALUE...
  local name=$1; shift
  echo "[$(date +%T)] $name: $*"
  env -u UCX_CUDA_IPC_ENABLE_GET_ZCOPY -u UCX_RNDV_SCHEME UCX_NET_DEVICES=lo UCX_PROTO_INFO=y "$@" \
    timeout 150 python3 "$G/ucx_bench.py" both --port $((27900 + RANDOM % 90)) > "$R/ucx-$name.out" 2> "$R/ucx-$name.err"
  echo "rc=$?"; grep "^{" "$R/ucx-$name.out" | tee "$R/ucx-$name.jsonl"
}
run default
run get_zcopy UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
run rndv_get UCX_RNDV_SCHEME=get_zcopy
run both UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y UCX_RNDV_SCHEME=get_zcopy
nvidia-smi topo -m > "$R/topo.txt" 2>&1
