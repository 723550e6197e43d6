"""Model architectures the compressing cache cannot serve, judged from the model's HF `config.json`.

Read in the launcher (before any weight is loaded) and again in the scheduler on the loaded config:
- hybrid sliding-window attention: SGLang keeps the windowed layers in a second KV pool this cache does
  not manage, and a window would drop tokens the policy counts as kept;
- MLA (DeepSeek V2/V3 and other models with a compressed latent KV, `kv_lora_rank`): the pool holds one
  latent per token instead of per-head keys and values, so there are no per-head keys to score or compact;
- multimodal rotary positions (mrope): a token's position is not its index plus an offset, so the
  logical positions of a compressed request cannot be recomputed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("sgl_kvevict")

_MLA_ARCHS = ("DeepseekV2", "DeepseekV3", "DeepseekV32", "KimiK2", "MiniCPM3")


def _sections(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The config and its nested language-model configs (multimodal wrappers keep them in `text_config`)."""
    out = [cfg]
    for key in ("text_config", "language_config", "llm_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict):
            out.append(sub)
    return out


def _rope_dicts(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in (c.get("rope_scaling"), c.get("rope_parameters")) if isinstance(d, dict)]


def refusal(cfg: dict[str, Any]) -> str | None:
    """Why this model cannot run under a compressing policy, or None."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    for c in _sections(cfg):
        layer_types = c.get("layer_types")
        if isinstance(layer_types, list) and any("sliding" in str(t) for t in layer_types):
            return "a hybrid sliding-window attention model (layer_types has sliding layers)"
        if c.get("use_sliding_window") is not False and c.get("sliding_window") not in (None, 0):
            return f"a sliding-window attention model (sliding_window={c.get('sliding_window')})"
        if c.get("sliding_window_pattern") not in (None, 0, 1):
            return "a hybrid sliding-window attention model (sliding_window_pattern)"
        if c.get("kv_lora_rank") not in (None, 0):
            return f"an MLA model (kv_lora_rank={c.get('kv_lora_rank')}: latent KV, no per-head keys)"
        for rope in _rope_dicts(c):
            if "mrope_section" in rope or rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
                return "an mrope model (multimodal rotary positions are not index + offset)"
    for a in archs:
        if a.startswith(_MLA_ARCHS):
            return f"an MLA model ({a}: latent KV, no per-head keys)"
    return None


def quantization(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's own weight quantization (`quantization_config.quant_method`), if any."""
    for c in _sections(cfg):
        q = c.get("quantization_config")
        if isinstance(q, dict):
            return str(q.get("quant_method") or "quantized checkpoint")
    return None


def read_config(model_path: str, revision: str | None = None, overrides: str | None = None) -> dict | None:
    """The model's `config.json` as a dict (a local folder, or the local Hugging Face cache), with
    `--json-model-override-args` applied; None when it cannot be found without loading anything."""
    path = Path(model_path) / "config.json"
    found: str | None = str(path) if path.is_file() else None
    if found is None and not Path(model_path).exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(model_path, "config.json", revision=revision)
            found = hit if isinstance(hit, str) else None
        except Exception:  # not a repo id, no cache: SGLang will say so itself
            found = None
    if found is None:
        return None
    with open(found) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        return None
    if overrides:
        try:
            extra = json.loads(overrides)
        except json.JSONDecodeError:
            extra = None
        if isinstance(extra, dict):
            cfg.update(extra)
    return cfg
