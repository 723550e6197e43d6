"""An 8B-shaped Llama model folder without weights, for SGLang's `--load-format dummy`.

The GPU check (`scripts/gpu_session.sh`) cannot download a model: it serves Llama-3.1-8B's attention and
MLP shapes (32 layers, 32 query heads, 8 KV heads of 128, hidden 4096, MLP 14336; Meta's published
config) with random weights, so memory and time per token are an 8B model's, while the answers are noise.
The tokenizer is the embedded SmolLM2's (`sgl_kvevict.model`), so the vocabulary is its 49,152 tokens
instead of 128,256 (the embedding and LM head are smaller than the real 8B's; the layers are not).

    python -m sgl_kvevict.gpu_model OUT_DIR [--layers N]     # N < 32: a small-layer variant (CPU checks)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "mlp_bias": False,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write(out: Path, layers: int = LLAMA_8B["num_hidden_layers"]) -> Path:
    """`out` gets config.json (8B-shaped, `layers` layers) and the embedded model's tokenizer files."""
    from sgl_kvevict.model import default_model_path

    src = default_model_path()
    small = json.loads((src / "config.json").read_text())
    cfg = {
        **LLAMA_8B,
        "num_hidden_layers": int(layers),
        "vocab_size": small["vocab_size"],
        "bos_token_id": small.get("bos_token_id"),
        "eos_token_id": small.get("eos_token_id"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"], help="1-32 (default 32)")
    args = ap.parse_args(argv)
    if not 1 <= args.layers <= 32:
        ap.error("--layers must be in [1, 32]")
    print(write(Path(args.out), args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
