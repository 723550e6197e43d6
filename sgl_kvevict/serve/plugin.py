"""SGLang plugin entry point (group `sglang.srt.plugins`), loaded by SGLang in every process.

It adds the `--kv-*` flags (`config.FLAGS`, made from the settings' models) to `launch_server` and the
matching keywords to `sgl.Engine`, validates them before the model loads (refusing, with exit code 2, the SGLang features
and model architectures compression cannot serve), hands the validated config to the other processes
through the environment, registers the compressing radix cache backend, and (when a policy is active)
installs the scheduler hooks. With `--kv-policy none` no cache backend or scheduler hook is installed:
SGLang runs unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any

from pydantic import BaseModel, ValidationError
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_kvevict import sizing
from sgl_kvevict.config import (
    FLAG,
    FLAGS,
    REQUEST_KEY,
    Flag,
    KvConfig,
    Launch,
    ServerSettings,
    first_error,
    request_override,
    server_config,
    spelling,
)
from sgl_kvevict.cpu_compat import bf16_linear
from sgl_kvevict.serve import modelcheck

logger = logging.getLogger("sgl_kvevict")
BACKEND_NAME = "kvevict"
# `module:function[,...]` the plugin calls in every SGLang process after its own set-up: how the test
# set-up registers its test-only policies (`sgl_kvevict.tools.testing:load`, tests/helpers.py) without an
# entry point that every server would import
EXTRA_LOAD_ENV = "KVEVICT_LOAD"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

# Attention backends that serve compacted rows: each builds its per-forward metadata from the live
# `req_to_token` rows and `seq_lens` (eagerly and before every CUDA-graph replay), so a row the plugin
# rewrote and a shorter `seq_lens` are what it reads (docs/deployment.md, "Attention backends").
# `fa3` is SGLang 0.5.23's default for Llama-class models on Hopper. Every other backend is refused
# under a compressing policy, whether given by a flag or chosen by SGLang's own resolution.
SUPPORTED_ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton", "torch_native")
SUGGESTED_BACKEND = "flashinfer"
_BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")

# The SGLang release whose internals the hooks patch (requirements/nodeps.txt pins the same). Another
# release fails at start unless the operator sets ALLOW_VERSION_ENV=1 to try it anyway.
SGLANG_VERSION = "0.5.23"
ALLOW_VERSION_ENV = "KVEVICT_ALLOW_SGLANG_VERSION"


def _argparse_type(flag: Flag):
    """An argparse `type` for `flag`: its parser, with a ValueError turned into argparse's exit 2."""

    def parse(text: str):
        try:
            return flag.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = flag.dest  # argparse names the type in some messages
    return parse


def add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args: our flags, one per model field (`config.FLAGS`)."""
    if any("--kv-policy" in a.option_strings for a in parser._actions):
        return result
    group = parser.add_argument_group("sgl-kvevict (KV-cache compression)")
    for flag in FLAGS:
        group.add_argument(
            flag.name,
            dest=flag.dest,
            type=_argparse_type(flag),
            default=None,
            metavar=flag.dest.upper() if flag.choices is None else "{" + ",".join(flag.choices) + "}",
            help=flag.help.replace("%", "%%"),
        )
    return result


class FlagError(ValueError):
    """A value the plugin refuses: exit 2 on the command line (`from_cli_args`), this ValueError from
    `sgl.Engine(...)` (`server_args_init`)."""


def _fail(msg: str) -> None:
    raise FlagError(msg)


def _given(ns: argparse.Namespace, flag: str):
    return getattr(ns, FLAG[flag].dest, None)


def from_cli_args(cls, ns: argparse.Namespace, *args, **kwargs):
    """BEFORE ServerArgs.from_cli_args: validate, publish to child processes, pick our radix cache. A
    refused value ends the launch with argparse's exit 2 and the reason."""
    if not hasattr(ns, "kv_policy"):  # a parser without our flags
        return None
    try:
        _apply(ns)
    except FlagError as e:
        print(f"sglang launch_server: error: {e}", file=sys.stderr)
        sys.exit(2)
    return None


def _apply(ns: argparse.Namespace) -> None:
    """Validate our flags in `ns`, publish the config and settings to child processes (environment),
    pick our radix cache. Raises FlagError naming what is refused."""
    policy = ns.kv_policy or FLAG["--kv-policy"].default
    model_cfg = _model_config(ns)
    launch = _launch(ns, policy, model_cfg)
    cfg, settings = launch.kv, launch.settings
    _check_host_bytes(ns, settings, model_cfg)
    cfg.publish()
    settings.publish()
    if cfg.active:
        current = getattr(ns, "radix_cache_backend", None)
        if current not in (None, BACKEND_NAME):
            _fail(f"--kv-policy {policy} needs --radix-cache-backend {BACKEND_NAME} (got {current!r})")
        if getattr(ns, "disable_radix_cache", False):
            _fail(f"--kv-policy {policy} needs the radix cache: drop --disable-radix-cache")
        ns.radix_cache_backend = BACKEND_NAME
        _restrict_features(ns, cfg, model_cfg)
        for dest in _BACKEND_FLAGS:
            why = backend_refusal(policy, getattr(ns, dest, None), f"--{dest.replace('_', '-')}")
            if why:
                _fail(why)


def _fields_given(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s fields whose flags `ns` gives, by field name."""
    return {f.field: _given(ns, f.name) for f in FLAGS if f.model is model and _given(ns, f.name) is not None}


def _launch(ns: argparse.Namespace, policy: str, model_cfg: dict | None) -> Launch:
    """The flags given in `ns`, and what SGLang's own say, validated together (`config.Launch`, whose
    validators are the rules that relate two settings). Raises FlagError with the first refusal."""
    kv = {**_fields_given(ns, KvConfig), "policy": policy}
    if "budget" in kv:
        kv["budget"] = spelling(kv["budget"])  # one token is {"tokens": 1}: a bare 1 is refused
    settings = {**_fields_given(ns, ServerSettings), "quantization": _quantization(ns, model_cfg)}
    try:
        return Launch.model_validate(
            {
                "kv": kv,
                "settings": settings,
                "scope": _given(ns, "--kv-scope"),
                "max_running_requests": getattr(ns, "max_running_requests", None),
            }
        )
    except ValidationError as e:
        raise FlagError(first_error(e)) from None


def backend_refusal(policy: str, backend: str | None, source: str) -> str | None:
    """Why `backend` (given by `source`: a flag, or SGLang's resolution) cannot serve compacted rows."""
    if backend is None or backend in SUPPORTED_ATTENTION_BACKENDS:
        return None
    return (
        f"--kv-policy {policy} does not support the {backend!r} attention backend ({source}): "
        f"supported: {', '.join(SUPPORTED_ATTENTION_BACKENDS)}; pass --attention-backend {SUGGESTED_BACKEND}"
    )


def resolved_refusal(server_args) -> str | None:
    """What SGLang's resolution chose that a compressing policy cannot serve, or None.

    SGLang picks the attention backend (and may raise the page size) while resolving its arguments,
    after our flags were read: FA3 on Hopper for Llama-class models, trtllm_mha on Blackwell (page size
    16-64), FlashInfer or Triton otherwise, and model- or feature-specific choices. This judges the
    prefill and decode backends (and page size) it resolved to."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolving_view

    cfg = server_config()
    if not cfg.active:
        return None
    view = resolving_view(server_args)
    prefill, decode = attention_backends_of(view)
    for phase, backend in (("prefill", prefill), ("decode", decode)):
        why = backend_refusal(cfg.policy, backend, f"SGLang's resolved {phase} backend")
        if why:
            return why
    page = getattr(view, "page_size", None)
    if page not in (None, 1):
        return f"--kv-policy {cfg.policy} compacts per token and needs page size 1 (SGLang resolved {page})"
    return None


def check_resolved(result, server_args, *args, **kwargs):
    """AFTER ServerArgs.resolve_once: refuse what SGLang resolved that compression cannot serve (exit 2 on
    the command line, FlagError from `sgl.Engine`), before any model weight is loaded."""
    why = resolved_refusal(server_args)
    if why:
        if getattr(server_args, "launch_command", None) is not None:  # set by the CLI's prepare_server_args
            print(f"sglang launch_server: error: {why}", file=sys.stderr, flush=True)
            sys.exit(2)
        raise FlagError(why)
    return result


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


def _check_host_bytes(ns: argparse.Namespace, settings: ServerSettings, model_cfg: dict | None) -> None:
    """`--kv-host-gib` in columns of this model (estimated from config.json; the scheduler converts with
    the exact shape): a size under one column or above the column bound is refused now."""
    if settings.host_gib is None or model_cfg is None:
        return
    try:
        shape = sizing.shape_of(
            model_cfg, getattr(ns, "tp_size", 1) or 1, getattr(ns, "kv_cache_dtype", None)
        )
    except (KeyError, TypeError, ValueError):
        return  # an unusual config.json: the scheduler still checks
    try:
        sizing.columns_for_bytes(settings.host_gib * sizing.GIB, shape)
    except ValueError as e:
        _fail(f"argument {e}")


def _quantization(ns: argparse.Namespace, model_cfg: dict | None) -> str | None:
    """How the weights are quantized, said as the flag or the checkpoint says it; None when they are not."""
    for flag in ("quantization", "modelopt_quant"):
        if getattr(ns, flag, None):
            return f"--{flag.replace('_', '-')} {getattr(ns, flag)}"
    if model_cfg is not None and modelcheck.quantization(model_cfg):
        return f"the checkpoint's quantization_config: {modelcheck.quantization(model_cfg)}"
    return None


def _restrict_features(ns: argparse.Namespace, cfg: KvConfig, model_cfg: dict | None) -> None:
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
    if model_cfg is not None:
        why = modelcheck.refusal(model_cfg)
        if why:
            _fail(f"--kv-policy {policy} cannot serve {ns.model_path}: {why}")
    if getattr(ns, "enable_mixed_chunk", False):
        ns.enable_mixed_chunk = False
        logger.warning(
            "sgl-kvevict: --enable-mixed-chunk switched off: mixed batches compute positions without our offsets"
        )


ENGINE_KEYS = tuple(f.dest for f in FLAGS)  # sgl.Engine(kv_policy=..., kv_scope=..., ...): one per flag


def engine_namespace(kwargs: dict) -> argparse.Namespace:
    """Take our keys (`ENGINE_KEYS`) out of `sgl.Engine`'s keyword arguments and check each as its flag
    would be checked: a string is parsed as on the command line; a number, dict or list is validated as
    the field's value (`--kv-overrides`: `{"policies": [...]}` or "off"). A bad value is a ValueError
    naming the keyword. Returns a namespace with the rest of `kwargs` and our values."""
    ns = argparse.Namespace(**{k: v for k, v in kwargs.items() if k not in ENGINE_KEYS})
    for flag in FLAGS:
        val = kwargs.get(flag.dest)
        if val is not None:
            try:
                val = flag.coerce(val)
            except ValueError as e:
                raise ValueError(f"{flag.dest}: {e}") from None
        setattr(ns, flag.dest, val)
    if ns.kv_policy is None:
        ns.kv_policy = "none"
    return ns


def server_args_init(*args, **kwargs):
    """ServerArgs keyword arguments of the offline `sgl.Engine(..., kv_policy="d2o", kv_budget=0.5)`.

    The Engine builds ServerArgs from its keyword arguments, which never pass through the CLI parser:
    take our keys out (ServerArgs has no such fields), validate them exactly as the CLI does,
    and apply what `from_cli_args` would set. A bad value is a ValueError naming the field.
    Returns (args, kwargs) to build ServerArgs with, or None when no key of ours is given.
    """
    if not any(k in kwargs for k in ENGINE_KEYS):
        return None
    ns = engine_namespace(kwargs)
    _apply(ns)  # a refused value raises FlagError (a ValueError), as a bad keyword does
    return args, {k: v for k, v in vars(ns).items() if k not in ENGINE_KEYS}


def _patch_engine() -> None:
    """Let `sgl.Engine` take our keyword arguments.

    ServerArgs is a msgspec struct (its constructor cannot be hooked) and HookRegistry would rebind
    every module's `ServerArgs` on a class replacement, so only the Engine's own factory attribute
    (`Engine.server_args_class`, what `Engine.__init__` calls after loading plugins) is wrapped, and
    only in a process that has imported the Engine.
    """
    mod = sys.modules.get("sglang.srt.entrypoints.engine")
    engine = getattr(mod, "Engine", None)
    if engine is None or engine.server_args_class.__module__ == __name__:
        return  # no Engine imported, or its factory is the wrapper below already
    base = engine.server_args_class

    class KvEvictServerArgs:
        """Builds a plain ServerArgs after taking kv_policy / kv_budget / kv_policy_config out."""

        def __new__(cls, *args, **kwargs):
            res = server_args_init(None, *args, **kwargs)
            if res is not None:
                args, kwargs = res[0][1:], res[1]
            return base(*args, **kwargs)

    engine.server_args_class = KvEvictServerArgs


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


def _load_extra(target: str) -> None:
    module, _, func = target.partition(":")
    if not module or not func:
        raise ValueError(f"{EXTRA_LOAD_ENV}: {target!r} is not module:function")
    getattr(importlib.import_module(module), func)()


def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def check_sglang_version() -> None:
    """Exit 2 when the installed SGLang is not the release the hooks were written for, unless
    `KVEVICT_ALLOW_SGLANG_VERSION=1` (then a warning): a newer SGLang would otherwise fail somewhere inside
    a hook, later and less clearly."""
    found = installed_sglang_version()
    if found == SGLANG_VERSION:
        return
    if os.environ.get(ALLOW_VERSION_ENV) == "1":
        logger.warning(
            "sgl-kvevict: SGLang %s is installed; the plugin was built for %s (allowed by %s=1)",
            found,
            SGLANG_VERSION,
            ALLOW_VERSION_ENV,
        )
        return
    print(
        f"sgl-kvevict: error: SGLang {found} is installed, but this plugin patches SGLang {SGLANG_VERSION}'s "
        f"internals: install sglang=={SGLANG_VERSION}, or set {ALLOW_VERSION_ENV}=1 to try {found} anyway",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(2)


def load() -> None:
    """Entry point. Cheap and idempotent; SGLang applies the registered hooks right after."""
    check_sglang_version()
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", from_cli_args, HookType.BEFORE)
    HookRegistry.register(f"{_SERVER_ARGS}.resolve_once", check_resolved, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.sampling.sampling_params.SamplingParams.verify", verify_request, HookType.AFTER
    )
    _register_backend()
    _patch_engine()
    if bf16_linear.enabled():  # asked for (the launcher does on CPU): see `cpu_compat.bf16_linear`
        HookRegistry.register(bf16_linear.TARGET, bf16_linear.apply, HookType.AROUND)
    for target in filter(None, os.environ.get(EXTRA_LOAD_ENV, "").split(",")):
        _load_extra(target.strip())
    cfg = server_config()
    if cfg.active:
        from sgl_kvevict.serve import hooks

        hooks.install(cfg)
