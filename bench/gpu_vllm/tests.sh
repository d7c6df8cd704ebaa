# tests.sh -- job: the gpu tests (both model styles in parallel), logs kept in the job dir.  (device.sh bg)
R=$JOBDIR
export HYBRIDPD_GPU_LOGDIR=$R/logs
python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_vllm.py -n 2 -v -rA --tb=long 2>&1 | tail -300
rc=${PIPESTATUS[0]}
. bench/gpu_vllm/serve_lib.sh
for f in "$R"/logs/*.serve.err; do keylines "$f" > "${f%.err}.keylines.txt"; done
exit "$rc"
