/opt/torch/.venv/bin/python3 -m hybridpd_cli.main verify /tmp/pytest-of-root/pytest-2/popen-gw1/test_gpu_pd_verify_and_outputs0/nemotronh --platform cuda --vllm-version 0.26.0 --no-enable-prefix-caching --kv-cache-memory 1GiB --max-model-len 512 --decode http://127.0.0.1:39607 --proxy http://127.0.0.1:46681 --prompt-tokens --json --isl 97 --kv-cache-dtype fp8
# exit 1
