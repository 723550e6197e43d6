"""Bad server flags fail at start, before the model is loaded, with a one-line message."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sgl_kvevict.launch import CPU_FLAGS

MISSING_MODEL = "/nonexistent/model-that-would-fail-to-load"


def start(*args: str, model: str = MISSING_MODEL) -> subprocess.Popen:
    """The real launcher in a process of its own."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *args]
    for flag, val in CPU_FLAGS.items():
        cmd += [flag] if val is None else [flag, val]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    # a hang guard, not a timed check: the launches run together, and on a loaded machine four niced
    # imports of SGLang sharing two cores took over 300 s each
    out, err = proc.communicate(timeout=1200)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# one case per layer that can refuse: argparse's choices, the plugin's start hook, SGLang's own
# features; the rest of the refusals run in process (test_bad_flags_refused_by_the_hook)
BAD_LAUNCHES = [
    (["--kv-policy", "bogus"], ["--kv-policy", "invalid choice", "lagkv", "d2o"]),
    (["--kv-policy", "lagkv", "--kv-budget", "1.5"], ["--kv-budget", "out of range"]),
    (["--kv-policy", "lagkv", "--enable-hierarchical-cache"], ["--enable-hierarchical-cache"]),
    (
        ["--kv-policy", "lagkv", "--decode-attention-backend", "trtllm_mha"],
        ["'trtllm_mha'", "--attention-backend flashinfer"],
    ),
]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Every launch of this file, started together when the first test asks: each is a fresh interpreter
    importing SGLang (tens of seconds, nearly all of it before the flags are read), so they share the
    cores instead of waiting in turn. Keyed by the flags; "mla" is `test_unsupported_model_exits_2_before_load`'s."""
    mla = tmp_path_factory.mktemp("mla")
    (mla / "config.json").write_text(
        json.dumps({**LLAMA, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512})
    )
    procs = {tuple(args): start(*args) for args, _ in BAD_LAUNCHES}
    procs["mla"] = start("--kv-policy", "lagkv", model=str(mla))
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize(("args", "needles"), BAD_LAUNCHES)
def test_bad_flags_exit_before_model_load(launches: dict, args, needles):
    res = finish(launches[tuple(args)])
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()[-1]) > 20  # the reason, on the last line
    err = res.stderr
    for needle in needles:
        assert needle in err, f"{needle!r} not in stderr:\n{err[-2000:]}"
    # Had the flags passed, SGLang would have tried (and failed) to load the missing model.
    assert MISSING_MODEL not in err.split("error:")[-1]
    assert "Load weight" not in res.stdout + err


def check_in_process(monkeypatch, capsys, args: list[str], model: str = MISSING_MODEL) -> tuple[int, str]:
    """SGLang's real parser with the plugin's flags and its `from_cli_args` hook, in this process (a
    launch costs ~30 s of imports here). Returns (exit code, stderr); 0 when the flags were accepted."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sgl_kvevict.config import ENV_VAR, SETTINGS_ENV_VAR
    from sgl_kvevict.serve import plugin

    monkeypatch.setenv(ENV_VAR, "")  # restored after the test: from_cli_args publishes into os.environ
    monkeypatch.setenv(SETTINGS_ENV_VAR, "")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    plugin.add_cli_args(None, parser)
    capsys.readouterr()
    try:
        ns = parser.parse_args(["--model-path", model, *args])
        plugin.from_cli_args(ServerArgs, ns)
    except SystemExit as e:
        return int(e.code or 0), capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--kv-policy", "d2o", "--pp-size", "2"], ["pipeline parallelism", "--pp-size 2"]),
        (["--kv-policy", "lagkv", "--kv-budget", "0"], ["--kv-budget", "out of range"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", "{lag: 3"], ["--kv-policy-config", "not valid JSON"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", '{"lag": -1}'], ["--kv-policy-config", "'lag'"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", '{"colour": 1}'], ["--kv-policy-config", "'colour'"]),
        (
            ["--kv-policy", "criticalkv", "--kv-policy-config", '{"base": "lagkv"}'],
            ["--kv-policy-config", "lagkv"],
        ),
        (
            ["--kv-policy", "graphkv", "--kv-policy-config", '{"base": "nope"}'],
            ["--kv-policy-config", "nope"],
        ),
        (["--kv-policy", "lagkv", "--page-size", "16"], ["--page-size 1"]),
        (
            ["--kv-policy", "h2o", "--kv-policy-config", '{"window": 64}'],
            ["--kv-policy-config", "'window' (64)", "'recent' (32)"],
        ),
        (
            ["--kv-policy", "graphkv", "--kv-policy-config", '{"base": "snapkv", "recent": 8, "window": 16}'],
            ["--kv-policy-config", "'window' (16)", "'recent' (8)"],
        ),
        (
            ["--kv-policy", "criticalkv", "--quantization", "fp8"],
            ["criticalkv", "o_proj", "--quantization fp8"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-overrides", '{"policies": "lagkv,bogus"}'],
            ["--kv-overrides", "'bogus'", "valid choices"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-overrides", '{"min_budget": "0"}'],
            ["--kv-overrides", "min_budget", "out of range"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-overrides", '{"min_budget": 1}'],
            ["--kv-overrides", "ambiguous", '"100%"', '{"tokens": 1}'],
        ),
        (["--kv-policy", "lagkv", "--kv-overrides", '{"colour": 1}'], ["--kv-overrides", "colour"]),
        (["--kv-policy", "lagkv", "--kv-overrides", "on"], ["--kv-overrides", "not valid JSON"]),
        (["--kv-policy", "lagkv", "--kv-scope", "tree"], ["--kv-scope", "invalid choice", "request, branch"]),
        (
            ["--kv-policy", "lagkv", "--kv-scope", "request", "--kv-policy-config", '{"scope": "branch"}'],
            ["--kv-scope", "'request'", "'branch'", "once"],
        ),
        (["--kv-policy", "snapkv", "--kv-recall-tokens", "4097"], ["--kv-recall-tokens", "[0, 4096]"]),
        (
            ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", "--kv-host-tokens", "0"],
            ["--kv-host-tokens", "out of range", "[1, 2097152]"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-budget", "1"],
            ["--kv-budget", "ambiguous", '"100%"', '{"tokens": 1}'],
        ),
        (["--kv-policy", "lagkv", "--kv-budget", "150%"], ["--kv-budget", "out of range"]),
        (
            ["--kv-policy", "lagkv", "--kv-compress-step-tokens", "0"],
            ["--kv-compress-step-tokens", "out of range"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-compress-step-tokens", "1e9"],
            ["--kv-compress-step-tokens", "integer"],
        ),
        (
            [
                "--kv-policy",
                "snapkv",
                "--kv-policy-config",
                '{"window": 48, "recent": 64}',
                "--kv-overrides",
                '{"max_window": 32}',
            ],
            ["--kv-overrides max_window 32", "window 48"],
        ),
        (  # the buffer's bound: once published and refused only by the scheduler's settings
            ["--kv-policy", "snapkv", "--kv-policy-config", '{"window": 5000, "recent": 5000}'],
            ["--kv-policy-config", "window 5000", "4096"],
        ),
        (
            ["--kv-policy", "snapkv", "--kv-overrides", '{"max_window": 0}'],
            ["--kv-overrides", "max_window", "greater than or equal to 1"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-overrides", '{"min_budget": "0.5,0.25"}'],
            ["--kv-overrides", "two ratio"],
        ),
        (
            ["--kv-policy", "lagkv", "--kv-overrides", '{"enabled": false, "policies": ["lagkv"]}'],
            ["--kv-overrides", "policies", "no effect", "enabled: false"],
        ),
        # attention backends that are not known to serve compacted rows, by flag (SGLang's own choice is
        # judged after its resolution: test_resolved_backend_is_judged)
        (
            ["--kv-policy", "snapkv", "--attention-backend", "trtllm_mha"],
            ["'trtllm_mha'", "--attention-backend", "supported: fa3, flashinfer, triton, torch_native"],
        ),
        (
            ["--kv-policy", "lagkv", "--decode-attention-backend", "fa4"],
            ["'fa4'", "--decode-attention-backend", "pass --attention-backend flashinfer"],
        ),
        (["--kv-policy", "d2o", "--prefill-attention-backend", "flex_attention"], ["'flex_attention'"]),
        # the host tier in bytes: bounded, one of the two sizes, only with recall
        (
            ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", "--kv-host-gib", "0"],
            ["--kv-host-gib", "out of range", "[0.001, 4096.0]"],
        ),
        (
            ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", "--kv-host-gib", "lots"],
            ["--kv-host-gib", "must be a number"],
        ),
        (
            ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", "--kv-host-gib", "nan"],
            ["--kv-host-gib", "[0.001, 4096.0]"],
        ),
        (
            [
                "--kv-policy",
                "snapkv",
                "--kv-recall-tokens",
                "8",
                "--kv-host-gib",
                "1",
                "--kv-host-tokens",
                "64",
            ],
            ["--kv-host-gib", "--kv-host-tokens", "give one"],
        ),
        (["--kv-policy", "snapkv", "--kv-host-gib", "1"], ["--kv-host-gib", "--kv-recall-tokens"]),
    ],
)
def test_bad_flags_refused_by_the_hook(monkeypatch, capsys, args, needles):
    code, err = check_in_process(monkeypatch, capsys, args)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"


def test_good_override_flags_are_published(monkeypatch, capsys):
    import os

    from sgl_kvevict.config import ENV_VAR, SETTINGS_ENV_VAR, KvConfig, ServerSettings

    args = [
        "--kv-policy",
        "d2o",
        "--kv-overrides",
        '{"policies": ["lagkv", "h2o"], "min_budget": "128,25%"}',
        "--kv-scope",
        "branch",
        "--kv-budget",
        '{"tokens": 1}',
        "--kv-compress-step-tokens",
        "4096",
    ]
    code, err = check_in_process(monkeypatch, capsys, args)
    assert code == 0, err
    got = ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR])
    assert got.step_tokens == 4096
    assert got.overrides.policies == ["h2o", "lagkv"]
    assert (got.overrides.min_budget_tokens, got.overrides.min_budget_ratio) == (128, 0.25)
    assert got.overrides.enabled and got.quantization is None
    cfg = KvConfig.model_validate_json(os.environ[ENV_VAR])
    assert cfg.budget == 1 and type(cfg.budget) is int  # one token, asked for explicitly
    assert cfg.config == {"scope": "branch"} and cfg.build().config.scope == "branch"
    for spelling, want in (("50%", 0.5), ("0.5", 0.5), ("1.0", 1.0), ("100%", 1.0), ("256", 256)):
        code, err = check_in_process(monkeypatch, capsys, ["--kv-policy", "d2o", "--kv-budget", spelling])
        assert code == 0, err
        got_b = KvConfig.model_validate_json(os.environ[ENV_VAR]).budget
        assert got_b == want and type(got_b) is type(want)


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512}, "sliding-window"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "MLA"),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "MLA"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, "mrope"),
        (
            {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}},
            "mrope",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config: awq"),  # criticalkv only
    ],
)
def test_unsupported_models_are_refused(monkeypatch, capsys, tmp_path: Path, extra: dict, needle: str):
    """Model-dependent refusals read the model folder's config.json in the launcher: exit 2, one line."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    policy = "criticalkv" if "quantization_config" in extra else "d2o"
    code, err = check_in_process(monkeypatch, capsys, ["--kv-policy", policy], model=str(tmp_path))
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert needle in last and f"--kv-policy {policy}" in last, last
    # the same model is fine without compression
    code, err = check_in_process(monkeypatch, capsys, ["--kv-policy", "none"], model=str(tmp_path))
    assert code == 0, err


def test_unsupported_model_exits_2_before_load(launches: dict):
    """Through the real launcher (a DeepseekV3 config.json, `launches`): exit code 2 and the reason on the
    last line, no weight loaded."""
    res = finish(launches["mla"])
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "MLA" in last and "--kv-policy lagkv" in last, last
    assert "Load weight" not in res.stdout + res.stderr


def test_supported_model_configs_pass_the_check():
    """The refusals do not catch ordinary models (Qwen2-style disabled sliding window, plain Llama)."""
    from sgl_kvevict.serve import modelcheck

    assert modelcheck.refusal(LLAMA) is None
    assert modelcheck.refusal({**LLAMA, "sliding_window": 32768, "use_sliding_window": False}) is None
    assert modelcheck.refusal({**LLAMA, "sliding_window": None}) is None
    assert modelcheck.refusal({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}) is None
    assert modelcheck.quantization(LLAMA) is None


@pytest.mark.parametrize(
    ("policy", "overrides", "capture"),
    [
        ("lagkv", {"enabled": False}, False),
        ("knorm", {"policies": ["streaming", "lagkv"]}, False),
        ("streaming", {}, True),  # any override may name an attention policy
        ("lagkv", {"policies": ["snapkv"]}, True),
        ("lagkv", {"policies": ["graphkv"]}, True),  # a refiner's base may be attention-based
        ("snapkv", {"enabled": False}, True),
        ("graphkv", {"enabled": False}, True),
    ],
)
def test_capture_buffer_only_when_a_request_may_capture(policy: str, overrides: dict, capture: bool) -> None:
    from sgl_kvevict.config import KvConfig, OverridePolicy, ServerSettings, capture_needed

    cfg = KvConfig.model_validate({"policy": policy, "budget": 0.5})
    settings = ServerSettings(overrides=OverridePolicy(**overrides))
    assert capture_needed(cfg, settings) == capture


@pytest.mark.parametrize(
    ("args", "window", "slots"),
    [
        (["--kv-policy", "lagkv", "--kv-overrides", "off"], None, 128),
        (["--kv-policy", "lagkv"], 32, 128),  # an override may name snapkv (default window 32)
        (["--kv-policy", "snapkv", "--kv-policy-config", '{"window": 48, "recent": 64}'], 48, 128),
        (
            ["--kv-policy", "h2o", "--kv-overrides", '{"max_window": 64}', "--max-running-requests", "8"],
            64,
            8,
        ),
        (["--kv-policy", "h2o", "--max-running-requests", "100000"], 32, 4096),  # capped: MAX_CAPTURE
    ],
)
def test_capture_buffer_size_is_published(monkeypatch, capsys, args, window, slots):
    """The window-query buffer's size reaches every process through the settings (see `capture`)."""
    import os

    from sgl_kvevict.config import SETTINGS_ENV_VAR, ServerSettings

    code, err = check_in_process(monkeypatch, capsys, args)
    assert code == 0, err
    settings = ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR])
    assert (settings.capture_window, settings.capture_slots) == (window, slots)


def test_override_window_above_the_capture_buffer_is_refused():
    from sgl_kvevict.config import KvConfig, ServerSettings, request_override

    base = KvConfig.model_validate({"policy": "snapkv", "budget": 0.5})
    settings = ServerSettings(capture_window=32)
    ok = {"kvevict": {"config": {"window": 32}}}
    assert request_override(ok, base, settings).build().config.window == 32
    with pytest.raises(ValueError, match="--kv-overrides max_window"):
        request_override({"kvevict": {"config": {"window": 64, "recent": 64}}}, base, settings)
    # an attention-free override is not concerned
    assert request_override({"kvevict": {"policy": "lagkv"}}, base, settings).policy == "lagkv"


def _gpu_check():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: gpu_check.py would run, not refuse")
def test_gpu_check_refuses_without_cuda(capsys) -> None:
    """benchmarks/gpu_check.py is for a GPU machine: here it must say so and exit 2, starting nothing."""
    mod = _gpu_check()
    assert mod.main(["--model-path", "m"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert mod.main(["--model-path", "m", "--policies", "nope"]) == 2
    assert "valid choices" in capsys.readouterr().err


def test_gpu_check_preflight_lists_every_missing_module(monkeypatch, tmp_path: Path) -> None:
    """`gpu_check.py --preflight` imports what a server imports at start: here every module it names
    exists in the pinned SGLang and imports; a module that imports two missing ones gets both listed in
    one run, not only the first (on a GPU each server start that stops at one costs minutes)."""
    mod = _gpu_check()
    assert mod.preflight() == []
    (tmp_path / "kvevict_entry_probe.py").write_text("import kvevict_absent_a\nimport kvevict_absent_b\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probes = ("kvevict_entry_probe", "kvevict_absent_a", "kvevict_absent_b")
    for name in probes:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        got = mod.preflight(probes[:1])
    finally:  # the placeholders stay out of the other tests' imports
        for name in probes:
            sys.modules.pop(name, None)
    assert [p.split(" (")[0] for p in got] == [
        "missing module kvevict_absent_a",
        "missing module kvevict_absent_b",
    ]


def test_cpu_servers_wait_passively_unless_told(monkeypatch) -> None:
    """On CPU the launcher sets OMP_WAIT_POLICY=PASSIVE (a server beside other work), but never over the
    user's own value; on CUDA it adds nothing."""
    from sgl_kvevict.launch import build_command

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _, env = build_command(["--model-path", "x"], cuda=False)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _, env = build_command(["--model-path", "x"], cuda=False)
    assert "OMP_WAIT_POLICY" not in env and env["SGLANG_USE_CPU_ENGINE"] == "1"
    _, env = build_command(["--model-path", "x"], cuda=True)
    assert "OMP_WAIT_POLICY" not in env and "SGLANG_USE_CPU_ENGINE" not in env


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--kv-policy", "lagkv", "--kv-scope", "branch"], {"scope": "branch"}),
        (["--kv-policy", "lagkv", "--kv-policy-config", '{"scope": "branch"}'], {"scope": "branch"}),
        (
            ["--kv-policy", "lagkv", "--kv-scope", "branch", "--kv-policy-config", '{"scope": "branch"}'],
            {"scope": "branch"},
        ),
        (["--kv-policy", "lagkv", "--kv-scope", "request"], {}),  # the default, written as no config
        (["--kv-policy", "lagkv", "--kv-recall-tokens", "8"], {"scope": "branch"}),  # recalls: branch
        (["--kv-policy", "lagkv", "--kv-recall-tokens", "8", "--kv-scope", "request"], {}),
        (
            ["--kv-policy", "lagkv", "--kv-recall-tokens", "8", "--kv-policy-config", '{"scope": "request"}'],
            {"scope": "request"},
        ),
    ],
)
def test_scope_flag_and_policy_config_agree(monkeypatch, capsys, args, want):
    """`--kv-scope` and `--kv-policy-config '{"scope": ...}'` are two spellings of one field; given
    neither way, a server that recalls runs in branch scope."""
    import os

    from sgl_kvevict.config import ENV_VAR, KvConfig

    code, err = check_in_process(monkeypatch, capsys, args)
    assert code == 0, err
    assert KvConfig.model_validate_json(os.environ[ENV_VAR]).config == want


def test_operator_json_settings_are_published(monkeypatch, capsys):
    """`--kv-overrides off` and `--kv-recall-config` reach every process through the settings."""
    import os

    from sgl_kvevict.config import SETTINGS_ENV_VAR, ServerSettings

    recall = '{"page": 4, "every": 3}'
    args = ["--kv-policy", "snapkv", "--kv-overrides", "off", "--kv-recall-tokens", "8", "--kv-recall-config"]
    code, err = check_in_process(monkeypatch, capsys, [*args, recall])
    assert code == 0, err
    got = ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR])
    assert not got.overrides.enabled and got.recall_tokens == 8
    assert got.recall.model_dump() == {"page": 4, "every": 3}


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--kv-recall-config", '{"page": 0}'], ["--kv-recall-config", "page", "greater than or equal to 1"]),
        (
            ["--kv-recall-config", '{"page": 257}'],
            ["--kv-recall-config", "page", "less than or equal to 256"],
        ),
        (
            ["--kv-recall-config", '{"every": 0}'],
            ["--kv-recall-config", "every", "greater than or equal to 1"],
        ),
        (
            ["--kv-recall-config", '{"every": 4097}'],
            ["--kv-recall-config", "every", "less than or equal to 4096"],
        ),
        (["--kv-recall-config", '{"page": 2.5}'], ["--kv-recall-config", "page", "integer"]),
        (["--kv-recall-config", '{"pages": 4}'], ["--kv-recall-config", "pages", "not permitted"]),
        # the keys of the recall routes that left: refused by name, not ignored
        (["--kv-recall-config", '{"segments": 2}'], ["--kv-recall-config", "segments", "not permitted"]),
        (["--kv-recall-config", '{"min_score": 0.1}'], ["--kv-recall-config", "min_score", "not permitted"]),
        (
            ["--kv-recall-config", '{"head_score": 0.1}'],
            ["--kv-recall-config", "head_score", "not permitted"],
        ),
        (["--kv-recall-config", "[1]"], ["--kv-recall-config", "JSON object"]),
    ],
)
def test_bad_recall_config_is_refused(monkeypatch, capsys, args, needles):
    code, err = check_in_process(
        monkeypatch, capsys, ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", *args]
    )
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"


def test_host_tier_settings_need_recall_tokens(monkeypatch, capsys):
    for args in (["--kv-recall-config", '{"page": 4}'], ["--kv-host-tokens", "100"]):
        code, err = check_in_process(monkeypatch, capsys, ["--kv-policy", "snapkv", *args])
        assert code == 2, err
        assert args[0] in err and "--kv-recall-tokens" in err.strip().splitlines()[-1]


def test_test_policies_come_from_the_test_set_up_only(monkeypatch) -> None:
    """No entry point of the package names the tools: the test set-up's servers load the test policies
    through the plugin's `KVEVICT_LOAD`, which calls each `module:function` it names."""
    from importlib.metadata import entry_points

    from sgl_kvevict.serve import plugin
    from tests.helpers import CHECKED_ENV

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("sgl_kvevict")]
    assert [ep.value for ep in eps] == ["sgl_kvevict.serve.plugin:load"]
    assert CHECKED_ENV[plugin.EXTRA_LOAD_ENV] == "sgl_kvevict.tools.testing:load"
    calls = []
    monkeypatch.setattr("sgl_kvevict.launch.has_cuda", lambda: calls.append(1) or False)
    plugin._load_extra("sgl_kvevict.launch:has_cuda")
    assert calls == [1]
    with pytest.raises(ValueError, match="module:function"):
        plugin._load_extra("sgl_kvevict.launch")


def test_a_plain_server_process_never_imports_the_test_policies() -> None:
    """In a fresh process: the plugin's `load` registers the test policies only when the set-up names them."""
    import os

    script = (
        "import sys\nfrom sgl_kvevict import policies\nfrom sgl_kvevict.serve import plugin\nplugin.load()\n"
        "print('RESULT', sorted(n for n in policies.REGISTRY if n.startswith('test_')), "
        "'sgl_kvevict.tools.testing' in sys.modules)"
    )
    from tests.helpers import CHECKED_ENV

    env = {k: v for k, v in os.environ.items() if k != "KVEVICT_LOAD"}
    procs = {  # both at once: each is a fresh interpreter importing SGLang
        name: subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, **extra},
        )
        for name, extra in (("plain", {}), ("tests", {"KVEVICT_LOAD": CHECKED_ENV["KVEVICT_LOAD"]}))
    }
    got = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=1200)  # a hang guard (see `finish`)
        (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
        got[name] = line
    assert got["plain"] == "RESULT [] False", got
    assert got["tests"] == "RESULT ['test_fault_staged', 'test_raise', 'test_recall_fault'] True", got


def test_supported_backends_pass_and_none_runs_any(monkeypatch, capsys) -> None:
    """Every backend the plugin supports is accepted under a policy (fa3: SGLang's Hopper default for
    Llama-class models), and without a policy SGLang runs unchanged with any backend."""
    from sgl_kvevict.serve import plugin

    for backend in plugin.SUPPORTED_ATTENTION_BACKENDS:
        code, err = check_in_process(
            monkeypatch, capsys, ["--kv-policy", "lagkv", "--attention-backend", backend]
        )
        assert code == 0, err
    code, err = check_in_process(
        monkeypatch, capsys, ["--kv-policy", "none", "--attention-backend", "trtllm_mha"]
    )
    assert code == 0, err


def test_gpu_check_covers_every_supported_cuda_backend() -> None:
    """benchmarks/gpu_check.py checks each backend the plugin accepts on CUDA (all but the CPU's
    torch_native), and no other."""
    from sgl_kvevict.serve import plugin

    mod = _gpu_check()
    assert set(mod.BACKENDS) == set(plugin.SUPPORTED_ATTENTION_BACKENDS) - {"torch_native"}


def _resolved(args: list[str], model: str):
    """A ServerArgs resolved by SGLang's own pipeline (its defaults, model overrides and validation)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sa = ServerArgs.from_cli_args(parser.parse_args(["--model-path", model, "--device", "cpu", *args]))
    sa.resolve_once()
    return sa


def test_resolved_backend_is_judged(monkeypatch, capsys, tmp_path: Path) -> None:
    """The start check (AFTER ServerArgs.resolve_once) judges the backends SGLang resolved, not the flags:
    a resolved backend the plugin does not support exits 2 naming it and the flag to pass; a supported one
    and a server without a policy pass. Here SGLang resolves on this CPU (flex_attention it keeps, its
    default for a CPU falls back to torch_native)."""
    from sgl_kvevict.config import ENV_VAR
    from sgl_kvevict.serve import plugin

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    flex = _resolved(["--attention-backend", "flex_attention"], str(tmp_path))
    default = _resolved([], str(tmp_path))
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "lagkv"}))
    flex._launch_command = "sglang serve ..."  # what the CLI's prepare_server_args sets (not sgl.Engine)
    with pytest.raises(SystemExit) as e:
        plugin.check_resolved(None, flex)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'flex_attention'" in err and "resolved" in err and "--attention-backend flashinfer" in err
    assert plugin.check_resolved("r", default) == "r"  # torch_native here
    flex._launch_command = None  # sgl.Engine: a ValueError naming the same
    with pytest.raises(ValueError, match="flex_attention"):
        plugin.check_resolved(None, flex)
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "none"}))
    assert plugin.check_resolved("r", flex) == "r"


def test_wrong_sglang_version_exits_2_unless_allowed(monkeypatch, capsys) -> None:
    """Another SGLang than the one the hooks patch ends the start with exit 2 naming both versions;
    KVEVICT_ALLOW_SGLANG_VERSION=1 lets an operator try it (a warning). The version the plugin expects is
    the one requirements/nodeps.txt installs, and the one installed here."""
    from sgl_kvevict.serve import plugin

    pins = (Path(__file__).resolve().parent.parent / "requirements" / "nodeps.txt").read_text()
    assert f"sglang=={plugin.SGLANG_VERSION}" in pins.split()
    assert plugin.installed_sglang_version() == plugin.SGLANG_VERSION
    plugin.check_sglang_version()  # the real one: passes
    monkeypatch.delenv(plugin.ALLOW_VERSION_ENV, raising=False)
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.24")
    with pytest.raises(SystemExit) as e:
        plugin.check_sglang_version()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "0.5.24" in err and plugin.SGLANG_VERSION in err and plugin.ALLOW_VERSION_ENV in err
    monkeypatch.setenv(plugin.ALLOW_VERSION_ENV, "1")
    plugin.check_sglang_version()  # allowed: returns


def test_host_gib_is_checked_against_the_model(monkeypatch, capsys, tmp_path: Path) -> None:
    """--kv-host-gib is turned into columns from the model's config.json at start: a size under one column
    or above the column bound exits 2 naming the bounds in GiB; a fitting one is published."""
    from sgl_kvevict import sizing
    from sgl_kvevict.config import MAX_HOST_TOKENS, SETTINGS_ENV_VAR, ServerSettings

    big = {**LLAMA, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 80, "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(big))
    shape = sizing.shape_of(big)
    assert shape.column_bytes == 2 * 80 * 8 * 128 * 2
    base = ["--kv-policy", "snapkv", "--kv-recall-tokens", "8", "--kv-host-gib"]
    over = MAX_HOST_TOKENS * shape.column_bytes / sizing.GIB * 1.01
    code, err = check_in_process(monkeypatch, capsys, [*base, f"{over:.3f}"], model=str(tmp_path))
    assert code == 2 and "[1, 2097152] columns" in err, err
    code, err = check_in_process(monkeypatch, capsys, [*base, "0.001"], model=str(tmp_path))
    assert code == 0, err  # 0.001 GiB is 3 columns of 320 KiB
    import os

    settings = ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR])
    assert settings.host_gib == 0.001
    cols = sizing.columns_for_bytes(settings.host_gib * sizing.GIB, shape)
    assert (
        sizing.host_bytes(shape, cols) <= settings.host_gib * sizing.GIB < sizing.host_bytes(shape, cols + 1)
    )
