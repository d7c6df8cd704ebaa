"""Model dir for `vllm serve --load-format dummy` from a bundled config: no weights, no remote code.

  python bench/gpu_vllm/make_nano_dir.py OUT [--config nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16]
      [--tokenizer-script ../shared/reference/vllm-cpu-examples/make_tokenizer.py]

Writes OUT/config.json: hybridpd's bundled config without its provenance keys (``_source``, ``_confidence``) and
without ``auto_map`` (vLLM and transformers know ``nemotron_h``), then runs make_tokenizer.py OUT VOCAB with the
config's vocab_size, so every id the dummy-weight model can emit decodes to something. Needs ``tokenizers``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("out", type=Path)
ap.add_argument("--config", default="nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
ap.add_argument("--tokenizer-script", type=Path,
                default=Path(__file__).resolve().parents[3] / "shared/reference/vllm-cpu-examples/make_tokenizer.py")
a = ap.parse_args()

cfg = json.loads(resources.files("hybridpd.data.configs").joinpath(f"{a.config}.json").read_text())
cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "auto_map"}
a.out.mkdir(parents=True, exist_ok=True)
(a.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
subprocess.run([sys.executable, str(a.tokenizer_script), str(a.out), str(cfg["vocab_size"])], check=True)
print(f"{a.out}: config {a.config} (vocab {cfg['vocab_size']}), byte-level tokenizer")
