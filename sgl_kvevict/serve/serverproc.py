"""Start and stop a real SGLang server (with this plugin) as a child process: for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from sgl_kvevict.launch import build_command


def free_port() -> int:
    """A free port for a server that binds it only seconds later, by SGLang's own picker: below the
    kernel's ephemeral range, where no outgoing connection (or `bind(0)`) can take it in the meantime.
    From 30000 up: SGLang picks the ports its schedulers bind later from 22000-29999, so two servers
    started side by side do not race for one port."""
    from sglang.srt.utils.network import get_free_port_below_ephemeral  # heavy: only when one is needed

    return get_free_port_below_ephemeral(low=30000, high=65535)  # capped under the ephemeral range


PORT_TAKEN = "address already in use"


def port_is_taken(port: int) -> bool:
    """Whether another process holds the port now, by SGLang's own check: done before a start, so a
    taken port costs a bind, not the minute SGLang spends loading before it binds its HTTP port."""
    from sglang.srt.utils.network import is_port_available  # heavy: only when a server starts

    return not is_port_available(port)


def stop_child(proc: subprocess.Popen, grace: float) -> None:
    """Stop a child started in its own session (`start_new_session=True`) with everything it spawned
    (a server's scheduler and detokenizer): SIGTERM to its process group, SIGKILL after `grace` s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port: another process holds it."""


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
        self.args = list(args)
        self.extra_env = env or {}
        self.own_port = port is None
        self.named_log = Path(log_path) if log_path else None
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self._use_port(port or free_port())

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd, base_env = build_command([*self.args, "--port", str(port), "--host", "127.0.0.1"])
        self.env = {**os.environ, **base_env, **self.extra_env}
        self.log_path = self.named_log or Path(f"/tmp/sgl-kvevict-server-{port}.log")

    def start(self, tries: int = 3) -> Server:
        """Start and wait for `/health_generate`. A port taken before the server bound it (another
        process got there first) costs a restart on a fresh port, when the port was ours to choose."""
        for _ in range(tries - 1):
            try:
                return self._start_once()
            except PortTaken:
                if not self.own_port:
                    raise
                print(f"[server] port {self.port} was taken; retrying", file=sys.stderr, flush=True)
                self._use_port(free_port())
        return self._start_once()

    def _start_once(self) -> Server:
        if port_is_taken(self.port):
            raise PortTaken(f"port {self.port} is in use by another process")
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
                if PORT_TAKEN in self.tail().lower():
                    self.stop()
                    raise PortTaken(f"port {self.port} is in use by another process") from None
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
        stop_child(self.proc, grace=30.0)
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

    def flush(self, wait: float = 60.0) -> None:
        """Empty the radix cache. SGLang refuses (HTTP 400) while a request is still finishing, so this
        asks again until `wait` s have passed, then raises: a test that relies on an empty tree must not
        run on a full one."""
        deadline = time.time() + wait
        while True:
            r = requests.post(self.url + "/flush_cache", timeout=60)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.5)
        if r.status_code != 200:
            raise RuntimeError(f"/flush_cache answered {r.status_code} for {wait:.0f} s: {r.text.strip()}")
