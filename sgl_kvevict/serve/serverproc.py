"""Start and stop a real SGLang server (with this plugin) as a child process: for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from sgl_kvevict.launch import build_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`with Server(["--kv-policy", "lagkv"]) as srv: requests.post(srv.url + "/generate", ...)`."""

    def __init__(
        self,
        args: list[str],
        port: int | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd, base_env = build_command([*args, "--port", str(self.port), "--host", "127.0.0.1"])
        self.env = {**os.environ, **base_env, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/sgl-kvevict-server-{self.port}.log")
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        print(
            f"[server] starting on :{self.port} (log {self.log_path}): {' '.join(self.cmd[3:])}",
            file=sys.stderr,
            flush=True,
        )
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.time()
        while time.time() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode}; log tail:\n{self.tail()}"
                )
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    print(f"[server] ready in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not ready after {self.timeout} s; log tail:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join([line for line in lines if "server_args=" not in line][-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.log.close()
        self.proc = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ------------------------------------------------------------------------------------
    def generate(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        timeout: float = 600,
        kv: dict | None = None,
        **sampling,
    ) -> dict:
        """Greedy `/generate`; `kv` is the per-request override (custom_params["kvevict"])."""
        body: dict = {"sampling_params": {"temperature": 0, **sampling}}
        if kv is not None:
            body["sampling_params"]["custom_params"] = {"kvevict": kv}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def server_info(self) -> dict:
        return requests.get(self.url + "/server_info", timeout=30).json()

    def flush(self) -> None:
        requests.post(self.url + "/flush_cache", timeout=60)
