/opt/torch/.venv/bin/python3 -m hybridpd_cli.main verify /tmp/pytest-of-root/pytest-3/popen-gw1/test_gpu_pd_verify_and_outputs0/nemotronh --platform cuda --vllm-version 0.24.0 --no-enable-prefix-caching --kv-cache-memory 1GiB --max-model-len 512 --decode http://127.0.0.1:36701 --proxy http://127.0.0.1:47475 --prompt-tokens --json
# exit 0
