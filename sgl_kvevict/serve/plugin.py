"""SGLang plugin entry point (group `sglang.srt.plugins`), loaded by SGLang in every process.

It adds `--kv-policy`, `--kv-budget`, `--kv-policy-config` and the operator's override controls
(`--kv-disable-request-override`, `--kv-override-policies`, `--kv-override-min-budget`) to
`launch_server`, validates them before the model loads (refusing, with exit code 2, the SGLang features
and model architectures compression cannot serve), hands the validated config to the other processes
through the environment, registers the compressing radix cache backend, and (when a policy is active)
installs the scheduler hooks. With `--kv-policy none` no cache backend or scheduler hook is installed:
SGLang runs unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pydantic import ValidationError
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_kvevict import policies
from sgl_kvevict.config import (
    DEFAULT_RECALL_EVERY,
    DEFAULT_RECALL_FETCH_PAGES,
    DEFAULT_RECALL_MIN_SCORE,
    DEFAULT_RECALL_PAGE,
    ENV_VAR,
    MAX_CAPTURE,
    MAX_HOST_TOKENS,
    MAX_RECALL_EVERY,
    MAX_RECALL_FETCH_PAGES,
    MAX_RECALL_PAGE,
    MAX_RECALL_TOKENS,
    MAX_STEP_TOKENS,
    REQUEST_KEY,
    SETTINGS_ENV_VAR,
    KvConfig,
    OverridePolicy,
    ServerSettings,
    parse_budget,
    parse_min_budget,
    request_override,
    server_config,
    short,
    spelling,
)
from sgl_kvevict.cpu_compat import bf16_linear
from sgl_kvevict.policies.base import PolicyConfig
from sgl_kvevict.serve import modelcheck

logger = logging.getLogger("sgl_kvevict")
BACKEND_NAME = "kvevict"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def _budget_arg(text: str) -> int | float:
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_arg(text: str) -> dict:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at char {e.pos}): {short(text)}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"JSON nested too deeply: {short(text)}") from None
    if not isinstance(val, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(val).__name__}")
    return val


def _min_budget_arg(text: str) -> tuple[int | None, float | None]:
    try:
        return parse_min_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _policies_arg(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"give policy names separated by commas; valid: {', '.join(policies.available())}"
        )
    bad = [p for p in names if p not in policies.REGISTRY]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown KV policy {short(bad[0])}; valid choices: {', '.join(policies.available())}"
        )
    return names


def add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args: our flags. Policy choices come from the policy registry."""
    if any("--kv-policy" in a.option_strings for a in parser._actions):
        return result
    group = parser.add_argument_group("sgl-kvevict (KV-cache compression)")
    group.add_argument(
        "--kv-policy",
        default="none",
        choices=policies.available(),
        help="KV compression policy for each request's own suffix",
    )
    group.add_argument(
        "--kv-budget",
        type=_budget_arg,
        default=None,
        help="tokens kept per KV head beyond sinks+recent window (e.g. 256), or a percent of the suffix "
        "(e.g. 50%%; 0.5 works too); the bare 1 is refused as ambiguous: write 100%% or '{\"tokens\": 1}'",
    )
    group.add_argument(
        "--kv-policy-config", type=_json_arg, default=None, help="policy config as JSON, e.g. '{\"lag\": 64}'"
    )
    group.add_argument(
        "--kv-disable-request-override",
        action="store_true",
        help="deny every per-request custom_params.kvevict (HTTP 400)",
    )
    group.add_argument(
        "--kv-override-policies",
        type=_policies_arg,
        default=None,
        help="comma-separated policies a per-request override may name (default: all)",
    )
    group.add_argument(
        "--kv-override-min-budget",
        type=_min_budget_arg,
        default=None,
        help="smallest budget an override may ask for: tokens (256), a percent (25%%, or 0.25) or both "
        "(256,25%%); "
        "a budget of a kind without a minimum is denied",
    )
    group.add_argument(
        "--kv-compress-step-tokens",
        type=_step_tokens_arg,
        default=None,
        help="cap on the region tokens compressed in one scheduler step (e.g. 4096): once a step has "
        "compressed that many, other requests' compressions wait for the next steps, so several large "
        "compressions do not stall the batch in the same step (one always runs; default: no cap)",
    )
    group.add_argument(
        "--kv-capture-window",
        type=_capture_arg,
        default=None,
        help="the most window queries any request may score with (default: the server policy's window, "
        "at least 32); a larger per-request window is HTTP 400",
    )
    group.add_argument(
        "--kv-capture-slots",
        type=_capture_arg,
        default=None,
        help="requests that can capture window queries at once (default 128; one preallocated buffer of "
        "slots x layers x window x query heads x head_dim; a request beyond it runs uncompressed)",
    )
    group.add_argument(
        "--kv-recall-tokens",
        type=_recall_arg,
        default=None,
        help="host tier: evicted entries go to host memory, and each turn recalls up to this many per "
        f"layer and KV head into its kept history (0 or absent: off; at most {MAX_RECALL_TOKENS})",
    )
    group.add_argument(
        "--kv-host-tokens",
        type=_host_arg,
        default=None,
        help="host tier capacity in columns (one evicted entry per layer and KV head each; default "
        "16384, needs --kv-recall-tokens); branches are dropped least-recently-used beyond it",
    )
    group.add_argument(
        "--kv-recall-page",
        type=_page_arg,
        default=None,
        help="host columns per recall page: an entry is ranked by the best entry of its page, so recall "
        f"brings an attended token's neighbours with it (default {DEFAULT_RECALL_PAGE}; at most "
        f"{MAX_RECALL_PAGE}; needs --kv-recall-tokens)",
    )
    group.add_argument(
        "--kv-recall-summary",
        choices=("minmax", "mean", "off"),
        default=None,
        help="how a recall finds what it needs in a large host history: score small per-page key summaries "
        "and fetch only the best pages (minmax: per-channel key bounds, the default; mean: the mean key, "
        "half the bytes) or off: score every host key (needs --kv-recall-tokens)",
    )
    group.add_argument(
        "--kv-recall-fetch-pages",
        type=_fetch_arg,
        default=None,
        help="pages a paged recall fetches at least, per layer and KV head, chosen by their summaries: "
        f"more finds more in a long host history and reads more host keys (default "
        f"{DEFAULT_RECALL_FETCH_PAGES}; at most {MAX_RECALL_FETCH_PAGES}; needs --kv-recall-tokens)",
    )
    group.add_argument(
        "--kv-recall-append",
        choices=("on", "off"),
        default=None,
        help="after each turn's prefill, bring the turn's best host entries back into up to R fresh slots "
        "appended to the row, displacing nothing, until the turn ends (default on; needs "
        "--kv-recall-tokens)",
    )
    group.add_argument(
        "--kv-recall-every",
        type=_every_arg,
        default=None,
        help="decode steps between recalls, each by its step's own query inside the step's forward (default "
        f"{DEFAULT_RECALL_EVERY}: every step; 0: only in each turn's prefill; at most {MAX_RECALL_EVERY}; needs "
        "--kv-recall-tokens)",
    )
    group.add_argument(
        "--kv-recall-min-score",
        type=_min_score_arg,
        default=None,
        help="the least attention probability a query must give a host page's best entry for the page to "
        f"come back (default {DEFAULT_RECALL_MIN_SCORE}; in [0, 1]; 0: beating the displaced entry is enough; "
        "needs --kv-recall-tokens)",
    )
    return result


def _int_arg(hi: int, what: str = "an integer", lo: int = 1):
    """An argparse type: an integer in [lo, hi], else a message naming the range."""

    def parse(text: str) -> int:
        try:
            val = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} in [{lo}, {hi}], got {short(text)}") from None
        if not lo <= val <= hi:
            raise argparse.ArgumentTypeError(f"{short(val)} out of range: must be in [{lo}, {hi}]")
        return val

    return parse


_capture_arg = _int_arg(MAX_CAPTURE)
_step_tokens_arg = _int_arg(MAX_STEP_TOKENS, "an integer number of tokens")
_recall_arg = _int_arg(MAX_RECALL_TOKENS, "an integer number of tokens", lo=0)
_host_arg = _int_arg(MAX_HOST_TOKENS, "an integer number of columns")
_page_arg = _int_arg(MAX_RECALL_PAGE, "an integer number of columns")
_every_arg = _int_arg(MAX_RECALL_EVERY, "an integer number of decode steps", lo=0)
_fetch_arg = _int_arg(MAX_RECALL_FETCH_PAGES, "an integer number of pages")


def _min_score_arg(text: str) -> float:
    """An argparse type: a probability in [0, 1], else a message naming the range."""
    try:
        val = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {short(text)}") from None
    if not 0.0 <= val <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{short(text)} out of range: must be in [0, 1]")
    return val


_in_engine = False  # set while validating an offline Engine's keyword arguments: errors raise instead


def _fail(msg: str) -> None:
    if _in_engine:
        raise ValueError(msg)
    print(f"sglang launch_server: error: {msg}", file=sys.stderr)
    sys.exit(2)


def from_cli_args(cls, ns: argparse.Namespace, *args, **kwargs):
    """BEFORE ServerArgs.from_cli_args: validate, publish to child processes, pick our radix cache."""
    policy = getattr(ns, "kv_policy", None)
    if policy is None:
        return None
    cfg_kwargs: dict = {"policy": policy, "config": ns.kv_policy_config or {}}
    if ns.kv_budget is not None:
        cfg_kwargs["budget"] = spelling(ns.kv_budget)
    try:
        cfg = KvConfig.model_validate(cfg_kwargs)
        cfg.build()
    except policies.PolicyConfigError as e:
        _fail(f"argument --kv-policy-config: {e}")
    except ValueError as e:
        _fail(f"argument --kv-policy: {e}")
    os.environ[ENV_VAR] = cfg.to_env()
    model_cfg = _model_config(ns)
    settings = _server_settings(ns, model_cfg)
    if cfg.active:
        settings = _capture_settings(ns, cfg, settings)
    if settings.recall_tokens and not cfg.active:
        _fail("--kv-recall-tokens recalls what a compressing policy evicted: give --kv-policy too")
    os.environ[SETTINGS_ENV_VAR] = settings.to_env()
    if cfg.active:
        current = getattr(ns, "radix_cache_backend", None)
        if current not in (None, BACKEND_NAME):
            _fail(f"--kv-policy {policy} needs --radix-cache-backend {BACKEND_NAME} (got {current!r})")
        if getattr(ns, "disable_radix_cache", False):
            _fail(f"--kv-policy {policy} needs the radix cache: drop --disable-radix-cache")
        ns.radix_cache_backend = BACKEND_NAME
        _restrict_features(ns, cfg, settings, model_cfg)
    return None


def _model_config(ns: argparse.Namespace) -> dict | None:
    """The model's config.json, read without loading the model (None when not found locally)."""
    path = getattr(ns, "model_path", None)
    if not path:
        return None
    try:
        return modelcheck.read_config(
            str(path), getattr(ns, "revision", None), getattr(ns, "json_model_override_args", None)
        )
    except (OSError, ValueError) as e:
        logger.warning("sgl-kvevict: could not read %s/config.json before loading (%s)", path, e)
        return None


def _server_settings(ns: argparse.Namespace, model_cfg: dict | None) -> ServerSettings:
    disabled = bool(getattr(ns, "kv_disable_request_override", False))
    allowed = getattr(ns, "kv_override_policies", None)
    min_budget = getattr(ns, "kv_override_min_budget", None)
    if disabled and (allowed is not None or min_budget is not None):
        other = "--kv-override-policies" if allowed is not None else "--kv-override-min-budget"
        _fail(f"{other} has no effect with --kv-disable-request-override (no override is allowed): drop one")
    tokens, ratio = min_budget if min_budget is not None else (None, None)
    recall = getattr(ns, "kv_recall_tokens", None) or 0
    tier = {}  # the host tier's settings given on the command line (--kv-host-tokens -> host_tokens, ...)
    tier_fields = (
        "host_tokens",
        "recall_page",
        "recall_summary",
        "recall_fetch_pages",
        "recall_append",
        "recall_every",
    )
    for field in (*tier_fields, "recall_min_score"):
        val = getattr(ns, f"kv_{field}", None)
        if val is None:
            continue
        if not recall:
            flag = "--kv-" + field.replace("_", "-")
            _fail(f"{flag} shapes the host tier, which is on only with --kv-recall-tokens N (N >= 1)")
        tier[field] = val
    quant = None
    for flag in ("quantization", "modelopt_quant"):
        if getattr(ns, flag, None):
            quant = f"--{flag.replace('_', '-')} {getattr(ns, flag)}"
            break
    if quant is None and model_cfg is not None and modelcheck.quantization(model_cfg):
        quant = f"the checkpoint's quantization_config: {modelcheck.quantization(model_cfg)}"
    try:
        return ServerSettings(
            overrides=OverridePolicy(
                enabled=not disabled, policies=allowed, min_budget_tokens=tokens, min_budget_ratio=ratio
            ),
            quantization=quant,
            step_tokens=getattr(ns, "kv_compress_step_tokens", None),
            recall_tokens=recall,
            **tier,
        )
    except ValidationError as e:  # the argparse types check first; this is a second line
        err = e.errors()[0]
        flag = "--kv-override-policies" if "policies" in err["loc"] else "--kv-override-min-budget"
        _fail(f"argument {flag}: {err['msg']}")
        raise  # unreachable: _fail exits


def _capture_settings(ns: argparse.Namespace, cfg: KvConfig, settings: ServerSettings) -> ServerSettings:
    """The window-query buffer's size when some request may capture (see `capture`), else none."""
    if not capture_needed(cfg, settings):
        return settings
    pol = cfg.build()
    own = pol.config.window if "attn" in pol.needs or settings.recall_tokens else 0
    window = getattr(ns, "kv_capture_window", None)
    if window is None:
        window = max(own, PolicyConfig.model_fields["window"].default)
    elif own > window:
        _fail(f"--kv-capture-window {window} is below the server policy's window {own}")
    slots = getattr(ns, "kv_capture_slots", None) or settings.capture_slots
    return settings.model_copy(update={"capture_window": window, "capture_slots": slots})


def capture_needed(cfg: KvConfig, settings: ServerSettings) -> bool:
    """Whether some request of this server may capture window queries (so it allocates the buffer).

    Attention-free policies (streaming, knorm, lagkv, a refiner over lagkv) never capture. A request
    override could ask for an attention-based policy, so overrides count too: the buffer is left out
    only when none can ask for one (any may, when `--kv-override-policies` is not given; a refiner's
    base may be attention-based). CUDA graphs stay on either way (the capture is graph-safe)."""
    if "attn" in cfg.build().needs or settings.recall_tokens > 0:  # recall scores with the window too
        return True
    if not settings.overrides.enabled:
        return False
    names = settings.overrides.policies
    if names is None:
        return True
    return any(
        "attn" in policies.REGISTRY[n].needs or issubclass(policies.REGISTRY[n], policies.Refiner)
        for n in names
    )


def _restrict_features(
    ns: argparse.Namespace, cfg: KvConfig, settings: ServerSettings, model_cfg: dict | None
) -> None:
    """Features that do not compose with per-request compaction: refuse or switch off, saying why."""
    policy = cfg.policy
    if getattr(ns, "page_size", None) not in (None, 1):
        _fail(f"--kv-policy {policy} compacts per token and needs --page-size 1 (got {ns.page_size})")
    if getattr(ns, "speculative_algorithm", None):
        _fail(f"--kv-policy {policy} does not support speculative decoding (--speculative-algorithm)")
    if getattr(ns, "enable_hierarchical_cache", False):
        _fail(
            f"--kv-policy {policy} does not support --enable-hierarchical-cache "
            "(host-memory copies of compressed rows are not managed)"
        )
    if int(getattr(ns, "pp_size", 1) or 1) > 1:
        _fail(
            f"--kv-policy {policy} does not support pipeline parallelism (--pp-size {ns.pp_size}): "
            "compression runs over all layers of one rank"
        )
    if settings.quantization and "o_proj" in cfg.build().needs:
        _fail(
            f"--kv-policy {policy} reads o_proj's weights, which are quantized "
            f"({settings.quantization}); use another policy or an unquantized model"
        )
    if model_cfg is not None:
        why = modelcheck.refusal(model_cfg)
        if why:
            _fail(f"--kv-policy {policy} cannot serve {ns.model_path}: {why}")
    if getattr(ns, "enable_mixed_chunk", False):
        ns.enable_mixed_chunk = False
        logger.warning(
            "sgl-kvevict: --enable-mixed-chunk switched off: mixed batches compute positions without our offsets"
        )


ENGINE_KEYS = ("kv_policy", "kv_budget", "kv_policy_config")


def server_args_init(*args, **kwargs):
    """ServerArgs keyword arguments of the offline `sgl.Engine(..., kv_policy="d2o", kv_budget=0.5)`.

    The Engine builds ServerArgs from its keyword arguments, which never pass through the CLI parser:
    take our three keys out (ServerArgs has no such fields), validate them exactly as the CLI does,
    and apply what `from_cli_args` would set. A bad value is a ValueError naming the field.
    Returns (args, kwargs) to build ServerArgs with, or None when no key of ours is given.
    """
    global _in_engine
    if not any(k in kwargs for k in ENGINE_KEYS):
        return None
    kv = {k: kwargs.pop(k, None) for k in ENGINE_KEYS}
    ns = argparse.Namespace(**kwargs)
    _in_engine = True
    try:
        ns.kv_policy = kv["kv_policy"] or "none"
        ns.kv_budget = _budget_arg(kv["kv_budget"]) if isinstance(kv["kv_budget"], str) else kv["kv_budget"]
        conf = kv["kv_policy_config"]
        ns.kv_policy_config = _json_arg(conf) if isinstance(conf, str) else conf
        from_cli_args(None, ns)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"kv_budget/kv_policy_config: {e}") from None
    finally:
        _in_engine = False
    kwargs.update({k: v for k, v in vars(ns).items() if k not in ENGINE_KEYS})
    return args, kwargs


def _patch_engine() -> None:
    """Let `sgl.Engine` take our keyword arguments.

    ServerArgs is a msgspec struct (its constructor cannot be hooked) and HookRegistry would rebind
    every module's `ServerArgs` on a class replacement, so only the Engine's own factory attribute
    (`Engine.server_args_class`, what `Engine.__init__` calls after loading plugins) is wrapped, and
    only in a process that has imported the Engine.
    """
    mod = sys.modules.get("sglang.srt.entrypoints.engine")
    engine = getattr(mod, "Engine", None)
    if engine is None or getattr(engine, "_kvevict_args", False):
        return
    base = engine.server_args_class

    class KvEvictServerArgs:
        """Builds a plain ServerArgs after taking kv_policy / kv_budget / kv_policy_config out."""

        def __new__(cls, *args, **kwargs):
            res = server_args_init(None, *args, **kwargs)
            if res is not None:
                args, kwargs = res[0][1:], res[1]
            return base(*args, **kwargs)

    engine.server_args_class = KvEvictServerArgs
    engine._kvevict_args = True


def verify_request(result, sampling_params, *args, **kwargs):
    """AFTER SamplingParams.verify (HTTP process): a bad per-request override is a ValueError -> HTTP 400."""
    custom = getattr(sampling_params, "custom_params", None)
    if not custom or REQUEST_KEY not in custom:
        return result
    base = server_config()
    cfg = request_override(custom, base)
    if cfg is not None and cfg.active and not base.active:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: this server runs without compression (--kv-policy none); "
            "start it with a policy (e.g. --kv-policy lagkv) to allow per-request overrides"
        )
    return result


def _register_backend() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, _build_tree_cache)


def _build_tree_cache(ctx):
    """The factory, imported only where a tree is built (the scheduler), so that `load` stays cheap."""
    from sgl_kvevict.serve.hooks import build_tree_cache

    return build_tree_cache(ctx)


def load() -> None:
    """Entry point. Cheap and idempotent; SGLang applies the registered hooks right after."""
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", from_cli_args, HookType.BEFORE)
    HookRegistry.register(
        "sglang.srt.sampling.sampling_params.SamplingParams.verify", verify_request, HookType.AFTER
    )
    _register_backend()
    _patch_engine()
    if not bf16_linear.native_bf16():  # every server on such a CPU, with or without a policy
        HookRegistry.register(bf16_linear.TARGET, bf16_linear.apply, HookType.AROUND)
    cfg = server_config()
    if cfg.active:
        from sgl_kvevict.serve import hooks

        hooks.install(cfg)
