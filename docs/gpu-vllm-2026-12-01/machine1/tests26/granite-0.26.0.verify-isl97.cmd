/opt/torch/.venv/bin/python3 -m hybridpd_cli.main verify /tmp/pytest-of-root/pytest-1/popen-gw1/test_gpu_pd_verify_and_outputs0/granite --platform cuda --vllm-version 0.26.0 --no-enable-prefix-caching --kv-cache-memory 1GiB --max-model-len 512 --decode http://127.0.0.1:33193 --proxy http://127.0.0.1:43059 --prompt-tokens --json --isl 97
# exit 0
