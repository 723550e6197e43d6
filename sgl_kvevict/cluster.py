"""N compressing SGLang workers behind `sglang-router` (cache-aware routing), all on loopback.

    python -m sgl_kvevict.cluster --workers 2 --port 30000 -- --kv-policy d2o --kv-budget 0.5 [sglang flags]

Every worker is `python -m sgl_kvevict.launch` with the arguments after `--` (so the embedded model and,
without CUDA, SGLang's CPU flags), on its own free port. Once all of them answer `/health_generate`,
the router starts on `--port` with `--policy cache_aware` and the worker URLs; the command prints the
URLs and runs until interrupted, then stops the router and every worker. A worker or the router that
dies stops the whole cluster (exit 1).

Compression pays only when a session's next turn lands on the worker holding its compressed history:
the router's cache-aware policy sends a request to the worker whose (approximate) prefix tree matches
it best, so the turns of one conversation stay on one worker while the load stays balanced.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import requests

from sgl_kvevict.serve.serverproc import Server, free_port

ROUTER_POLICIES = ("cache_aware", "manual", "round_robin", "random", "power_of_two")
# A worker busy on a small CPU answers /health slowly; the router's defaults (a few seconds, three
# failures) would mark it dead mid-run and answer 503. Generous limits; flags given later win.
PATIENT_ROUTER = [
    "--health-check-timeout-secs",
    "60",
    "--health-failure-threshold",
    "10",
    "--request-timeout-secs",
    "3600",
]


class Router:
    """`python -m sglang_router.launch_router` in front of given worker URLs, on loopback."""

    def __init__(
        self,
        worker_urls: list[str],
        port: int | None = None,
        policy: str = "cache_aware",
        log_path: str | Path | None = None,
        extra: list[str] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(worker_urls)
        self.cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--worker-urls",
            *self.workers,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            *PATIENT_ROUTER,
            *(extra or []),
        ]
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/sgl-kvevict-router-{self.port}.log")
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> Router:
        print(f"[router] starting on :{self.port} (log {self.log_path})", file=sys.stderr, flush=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.time()
        while time.time() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited with code {self.proc.returncode}; log tail:\n{self.tail()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200 and self._all_healthy():
                    print(f"[router] ready in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"router not ready after {self.timeout} s; log tail:\n{self.tail()}")

    def _all_healthy(self) -> bool:
        """The router registers workers in the background: ready once it lists every one as healthy."""
        listed = requests.get(self.url + "/workers", timeout=5).json().get("workers", [])
        return len(listed) == len(self.workers) and all(w.get("is_healthy") for w in listed)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        self.proc = None

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Cluster:
    """`with Cluster(2, ["--kv-policy", "d2o"]) as c: requests.post(c.url + "/generate", ...)`.

    `c.workers` are the `Server`s (for per-worker checks: `/server_info`, `/flush_cache`); `c.url` is
    the router's.
    """

    def __init__(
        self,
        n_workers: int,
        worker_args: list[str],
        port: int | None = None,
        policy: str = "cache_aware",
        env: dict[str, str] | None = None,
        log_dir: str | Path | None = None,
        router_args: list[str] | None = None,
    ) -> None:
        if not 1 <= n_workers <= 16:
            raise ValueError(f"workers must be between 1 and 16 (got {n_workers})")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)} (got {policy!r})")
        log_dir = Path(log_dir) if log_dir else None
        self.workers = [
            Server(worker_args, env=env, log_path=log_dir / f"worker-{i}.log" if log_dir else None)
            for i in range(n_workers)
        ]
        self.router = Router(
            [w.url for w in self.workers],
            port=port,
            policy=policy,
            log_path=log_dir / "router.log" if log_dir else None,
            extra=router_args,
        )
        self.url = self.router.url
        self._stack = ExitStack()

    def start(self) -> Cluster:
        try:
            for w in self.workers:  # stopped in reverse order on exit, started or not
                self._stack.callback(w.stop)
            with ThreadPoolExecutor(len(self.workers)) as ex:  # all workers load at once
                for f in [ex.submit(w.start) for w in self.workers]:
                    f.result()
            self._stack.enter_context(self.router)
        except BaseException:
            self._stack.close()
            raise
        return self

    def alive(self) -> bool:
        return self.router.alive() and all(w.alive() for w in self.workers)

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="number of SGLang workers (1-16)")
    p.add_argument("--port", type=int, default=30000, help="the router's port (workers take free ports)")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES)
    p.add_argument("--log-dir", default=None, help="worker and router logs (default: /tmp)")
    args = p.parse_args(argv)
    if not 1 <= args.workers <= 16:
        p.error(f"argument --workers: must be between 1 and 16 (got {args.workers})")
    cluster = Cluster(args.workers, worker_args, args.port, args.router_policy, log_dir=args.log_dir)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with cluster:
        print(
            f"[cluster] router {cluster.url} (cache-aware) -> workers {', '.join(w.url for w in cluster.workers)}"
        )
        print("[cluster] Ctrl-C stops the router and every worker", flush=True)
        while not stop["now"]:
            if not cluster.alive():
                print("[cluster] a worker or the router exited; stopping", file=sys.stderr)
                return 1
            time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
