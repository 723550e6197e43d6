"""Build and run the `python -m sglang.launch_server` command for this machine.

On a machine without CUDA it adds SGLang's CPU flags (`--device cpu --attention-backend torch_native
--sampling-backend pytorch --disable-cuda-graph --sleep-on-idle`), `SGLANG_USE_CPU_ENGINE=1`,
`OMP_WAIT_POLICY=PASSIVE` and the CPU compatibility switch `KVEVICT_BF16_LINEAR=fp64` (see `CPU_ENV`), and defaults `--model-path` to the embedded SmolLM2. Every
other argument is passed through unchanged.

    python -m sgl_kvevict.launch --kv-policy lagkv --kv-budget 256 [any sglang flag ...]
"""

from __future__ import annotations

import os
import shlex
import sys


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


CPU_FLAGS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--disable-cuda-graph": None,
    "--sleep-on-idle": None,
    "--mem-fraction-static": "0.1",
    "--host": "127.0.0.1",
}


# OpenMP threads that wait for each other sleep instead of spinning: on a busy machine a spinning thread
# burns the time slice its preempted partner needs (one request beside two busy processes: 54.8 s once,
# 5.4-7.8 s otherwise, with OpenMP's default; 5.4-5.6 s with PASSIVE; idle: 4.24 vs 4.38 s;
# measured by `benchmarks/omp_wait.py`, removed after commit 55a1648). Servers on CPU often share their cores, so PASSIVE is the default there.
# KVEVICT_BF16_LINEAR=fp64: bf16 linear layers in fp64 where the CPU lacks bf16 instructions (prefill
# 2.4x faster on an AVX2-only EPYC; `cpu_compat/bf16_linear.py`). The plugin installs it only when asked.
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "KVEVICT_BF16_LINEAR": "fp64"}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _int_flag(argv: list[str], names: tuple[str, ...], default: int = 1) -> int:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return int(argv[i + 1])
            if a.startswith(n + "="):
                return int(a.split("=", 1)[1])
    return default


def cpu_binding(ranks: int, cores: int) -> str | None:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `ranks` CPU ranks: disjoint core ranges, one per rank.

    SGLang's CPU path binds each rank to a NUMA node and refuses more ranks than nodes unless this is set
    (a 2-core, 1-node machine with `--dp-size 2`). None when the cores cannot be split."""
    if ranks <= 1 or cores < ranks:
        return None
    per = cores // ranks
    return "|".join(f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(ranks))


def build_command(argv: list[str], cuda: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The full server command and the extra environment it needs."""
    cuda = has_cuda() if cuda is None else cuda
    args = list(argv)
    env: dict[str, str] = {"HF_HUB_OFFLINE": "1"}
    if not _given(args, "--model-path") and not _given(args, "--model"):
        from sgl_kvevict.model import default_model_path

        args = ["--model-path", str(default_model_path())] + args
    if not cuda:
        env.update({k: v for k, v in CPU_ENV.items() if k not in os.environ})
        ranks = _int_flag(args, ("--dp-size", "--dp")) * _int_flag(args, ("--tp-size", "--tp"))
        bind = cpu_binding(ranks, os.cpu_count() or 1)
        if bind and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = bind
        for flag, val in CPU_FLAGS.items():
            if flag == "--mem-fraction-static" and _given(args, "--max-total-tokens"):
                continue
            if not _given(args, flag):
                args += [flag] if val is None else [flag, val]
    return [sys.executable, "-m", "sglang.launch_server", *args], env


def main() -> None:
    cmd, env = build_command(sys.argv[1:])
    print(
        "[launch] " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd),
        file=sys.stderr,
        flush=True,
    )
    os.environ.update(env)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
