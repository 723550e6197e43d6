"""Build and run the `python -m sglang.launch_server` command for this machine.

On a machine without CUDA it adds SGLang's CPU flags (`--device cpu --attention-backend torch_native
--sampling-backend pytorch --disable-cuda-graph --sleep-on-idle`) and `SGLANG_USE_CPU_ENGINE=1`, and
defaults `--model-path` to the embedded SmolLM2. Every other argument is passed through unchanged.

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


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def build_command(argv: list[str], cuda: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The full server command and the extra environment it needs."""
    cuda = has_cuda() if cuda is None else cuda
    args = list(argv)
    env: dict[str, str] = {"HF_HUB_OFFLINE": "1"}
    if not _given(args, "--model-path") and not _given(args, "--model"):
        from sgl_kvevict.model import default_model_path

        args = ["--model-path", str(default_model_path())] + args
    if not cuda:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
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
