# . env.sh -- environment for CUDA vLLM 0.26.0 from the payload that pc.sh unpacked to /tmp/h26 (facts from
# ../shared/reference/gpu-vllm/README.md section 5). UCX variables are NOT set here: pc_job.sh and ucx.sh set them.
H=/tmp/h26
export PYTHONPATH=$H/pack/site:$H/hpd:$H/shim
export PATH=$H/pack/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0      # flashinfer is not carried
export VLLM_SSM_CONV_STATE_LAYOUT=DS      # NIXL + Mamba needs the DS conv layout
export VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_LOG_STATS_INTERVAL=5
