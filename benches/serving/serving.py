"""What the serving benchmarks share: a results file's run description (`run_meta`), and a real
`python -m mbd_rs serve` process on 127.0.0.1 (soak.py, hostile_serve.py, serve_batching.py's port): started on a free port (retried on a fresh one if another process takes it first), its
output in a log file, /health polled, stopped with a signal and killed if it does not exit."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

HOST = "127.0.0.1"


def run_meta() -> dict[str, Any]:
    """What a results file says of its run: the date, the commit, the CPU (AVX-512 or not), its cores, and the
    build of mbd_rs this interpreter imports (a development build is said on stderr: its numbers are not a
    release's)."""
    import platform

    import mbd_rs
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    debug = bool(getattr(mbd_rs._core, "debug_build", False))
    if debug:
        print("warning: mbd_rs is a development build (debug assertions, opt-level 1): build with --release "
              "(or --profile profiling) before measuring", file=sys.stderr)
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": platform.processor() or platform.machine(),
            "avx512": "avx512f" in flags, "cores": os.cpu_count(), "build": "development" if debug else "release"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerProc:
    """`python -m mbd_rs serve *flags` in its own process; `api_key`: served with --api-key and sent with health
    checks; `stop_signal`: what `stop` sends first."""

    def __init__(self, *flags: str, api_key: str | None = None, start_timeout: float = 60.0,
                 stop_signal: int = signal.SIGINT, log_prefix: str = "mbd-server-"):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stop_signal = stop_signal
        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
        key = ["--api-key", api_key] if api_key else []
        for _ in range(3):  # the free-port probe can race another process: retry on a fresh port
            self.port = free_port()
            self.base = f"http://{HOST}:{self.port}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mbd_rs", "serve", "--host", HOST, "--port", str(self.port), *key, *flags],
                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.time() + start_timeout
            while time.time() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(self.base + "/health", headers=self.headers, timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"server did not start; log: {self.log_text()[-2000:]}")

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.base + "/health", headers=self.headers, timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def wait_active(self, want: int, timeout: float) -> tuple[int, float]:
        """Poll /health until `active` is `want` or `timeout` passes; (active at the end, seconds waited)."""
        t0 = time.time()
        active = self.health()["active"]
        while active != want and time.time() - t0 < timeout:
            time.sleep(0.02)
            active = self.health()["active"]
        return active, time.time() - t0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode
