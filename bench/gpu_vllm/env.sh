# . bench/gpu_vllm/env.sh V -- environment for CUDA vLLM from payload V (24|26) unpacked by device.sh, with this
# checkout (the current directory) as hybridpd. Facts from ../shared/reference/gpu-vllm/README.md §5.
V=${1:?payload}
H=/tmp/hpd
mkdir -p "$H/shim-$V"; rm -f "$H/shim-$V/hybridpd_cli"; ln -s "$(pwd)/cli" "$H/shim-$V/hybridpd_cli"
export PYTHONPATH=$H/$V/pack/site:$(pwd):$H/shim-$V:$(pwd)/tests
export PATH=$H/$V/pack/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0      # flashinfer is not carried
export VLLM_SSM_CONV_STATE_LAYOUT=DS      # NIXL + Mamba needs the DS conv layout (serve sets it too)
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y     # D's READs by cuda_ipc zero-copy
export UCX_NET_DEVICES=lo VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HYBRIDPD_VLLM_PYTHON=python3 HYBRIDPD_VLLM_EXAMPLES=$H/gvex VLLM_LOG_STATS_INTERVAL=2
