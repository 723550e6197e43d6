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

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_kvevict import policies, sizing
from sgl_kvevict.config import (
    DEFAULT_CAPTURE_SLOTS,
    ENV_VAR,
    FLAG,
    FLAGS,
    MAX_CAPTURE,
    REQUEST_KEY,
    SETTINGS_ENV_VAR,
    Flag,
    KvConfig,
    ServerSettings,
    request_override,
    server_config,
    spelling,
)
from sgl_kvevict.cpu_compat import bf16_linear
from sgl_kvevict.policies.base import PolicyConfig
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


def _kv_config(ns: argparse.Namespace, policy: str, recalls: bool) -> KvConfig:
    """`--kv-policy`, `--kv-budget`, `--kv-scope`, `--kv-policy-config` -> the server's config.

    The scope may come from `--kv-scope` or from `--kv-policy-config '{"scope": ...}'` (the spelling a
    request uses); given both ways, they must agree (exit 2 otherwise). Given neither way, it is `branch`
    on a server that recalls (`recalls`): one budget caps a conversation's whole history, and what an
    earlier turn lost comes back from the host when a later turn asks for it."""
    conf = dict(_given(ns, "--kv-policy-config") or {})
    scope = _given(ns, "--kv-scope")
    if scope is None and "scope" not in conf and recalls:
        conf["scope"] = "branch"
    if scope is not None:
        if conf.get("scope", scope) != scope:
            _fail(
                f"argument --kv-scope: {scope!r} contradicts --kv-policy-config's scope "
                f"{conf['scope']!r}: give the scope once"
            )
        if scope != PolicyConfig.model_fields["scope"].default:
            conf["scope"] = scope
    cfg_kwargs: dict = {"policy": policy, "config": conf}
    budget = _given(ns, "--kv-budget")
    if budget is not None:
        cfg_kwargs["budget"] = spelling(budget)
    try:
        cfg = KvConfig.model_validate(cfg_kwargs)
        cfg.build()
    except policies.PolicyConfigError as e:
        _fail(f"argument --kv-policy-config: {e}")
    except ValueError as e:
        _fail(f"argument --kv-policy: {e}")
    return cfg


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
    settings = _server_settings(ns, model_cfg)
    cfg = _kv_config(ns, policy, recalls=settings.recall_tokens > 0 and policy != "none")
    os.environ[ENV_VAR] = cfg.to_env()
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
        for dest in _BACKEND_FLAGS:
            why = backend_refusal(policy, getattr(ns, dest, None), f"--{dest.replace('_', '-')}")
            if why:
                _fail(why)


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


def _server_settings(ns: argparse.Namespace, model_cfg: dict | None) -> ServerSettings:
    """The `ServerSettings` fields given as flags, plus the weights' quantization."""
    given = {}
    for flag in FLAGS:
        if flag.model is ServerSettings and _given(ns, flag.name) is not None:
            given[flag.field] = _given(ns, flag.name)
    if not given.get("recall_tokens"):
        for name in ("--kv-host-tokens", "--kv-host-gib", "--kv-recall-config"):
            if _given(ns, name) is not None:
                _fail(f"{name} shapes the host tier, which is on only with --kv-recall-tokens N (N >= 1)")
    if given.get("host_gib") is not None:
        if _given(ns, "--kv-host-tokens") is not None:
            _fail("--kv-host-gib and --kv-host-tokens both size the host tier: give one")
        if model_cfg is not None:  # estimated from config.json; the scheduler converts with the exact shape
            try:
                shape = sizing.shape_of(
                    model_cfg, getattr(ns, "tp_size", 1) or 1, getattr(ns, "kv_cache_dtype", None)
                )
            except (KeyError, TypeError, ValueError):
                shape = None  # an unusual config.json: the scheduler still checks
            if shape is not None:
                try:
                    sizing.columns_for_bytes(given["host_gib"] * sizing.GIB, shape)
                except ValueError as e:
                    _fail(f"argument {e}")
    quant = None
    for flag in ("quantization", "modelopt_quant"):
        if getattr(ns, flag, None):
            quant = f"--{flag.replace('_', '-')} {getattr(ns, flag)}"
            break
    if quant is None and model_cfg is not None and modelcheck.quantization(model_cfg):
        quant = f"the checkpoint's quantization_config: {modelcheck.quantization(model_cfg)}"
    return ServerSettings(quantization=quant, **given)


def _capture_settings(ns: argparse.Namespace, cfg: KvConfig, settings: ServerSettings) -> ServerSettings:
    """The window-query buffer's size when some request may capture (see `capture`), else none.

    Its window is the server policy's (at least the default 32), or the operator's `--kv-overrides`
    `max_window`; its slots are `--max-running-requests` (every running request can capture), else 128."""
    if not capture_needed(cfg, settings):
        return settings
    pol = cfg.build()
    own = pol.config.window if "attn" in pol.needs or settings.recall_tokens else 0
    window = settings.overrides.max_window
    if window is None:
        window = max(own, PolicyConfig.model_fields["window"].default)
    elif own > window:
        _fail(f"--kv-overrides max_window {window} is below the server policy's window {own}")
    running = getattr(ns, "max_running_requests", None)
    slots = min(int(running), MAX_CAPTURE) if running else DEFAULT_CAPTURE_SLOTS
    return settings.model_copy(update={"capture_window": window, "capture_slots": slots})


def capture_needed(cfg: KvConfig, settings: ServerSettings) -> bool:
    """Whether some request of this server may capture window queries (so it allocates the buffer).

    Attention-free policies (streaming, knorm, lagkv, a refiner over lagkv) never capture. A request
    override could ask for an attention-based policy, so overrides count too: the buffer is left out
    only when none can ask for one (any may, when `--kv-overrides` names no `policies`; a refiner's
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
