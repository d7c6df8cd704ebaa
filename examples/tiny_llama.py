"""Write a tiny Llama model directory for trying `hybridpd serve` on a CPU: config, byte-level tokenizer, no weights.

    .venv-vllm/bin/python examples/tiny_llama.py /tmp/tiny-llama

vLLM then runs it with `--load-format dummy` (random weights): the output is noise, the P/D mechanics are real.
Needs only the `tokenizers` package (vLLM depends on it). Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
    "vocab_size": 512, "torch_dtype": "bfloat16", "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "bos_token_id": 256, "eos_token_id": 257, "tie_word_embeddings": False,
}


def main(dst: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for the bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": CONFIG["max_position_embeddings"]}))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")
