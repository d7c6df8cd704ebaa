/opt/torch/.venv/bin/python3 -m hybridpd_cli.main verify /tmp/pytest-of-root/pytest-2/popen-gw0/test_gpu_pd_verify_and_outputs0/granite --platform cuda --vllm-version 0.26.0 --no-enable-prefix-caching --kv-cache-memory 1GiB --max-model-len 512 --decode http://127.0.0.1:55863 --proxy http://127.0.0.1:45215 --prompt-tokens --json --isl 97
# exit 0
