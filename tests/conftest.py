import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PARITY = os.path.join(HERE, "fixtures", "parity")


def pytest_configure(config):
    # Registered here (not in pyproject.toml) so that it holds where scripts/release-check.sh runs a copy of tests/.
    config.addinivalue_line("markers", "source_tree: needs the repository's files besides tests/ and README.md "
                            "(deselected when an installed wheel is tested)")
    config.addinivalue_line("markers", "slow: takes tens of seconds (real-shape checkpoints); scripts/test.sh runs "
                            "it with --all, as CI does")


def parity_dir(name):
    return os.path.join(PARITY, name)


def load_cases():
    with open(os.path.join(PARITY, "cases.json")) as f:
        return json.load(f)


def run_child(code, *args, limit_mb=None, timeout=300):
    """`code` (dedented) run by a fresh Python with `args` as its argv, tests/ importable, under an address-space
    limit of `limit_mb` MB when given (for cases that could abort or exhaust the process); the CompletedProcess."""
    prelude = f"import sys\nsys.path.insert(0, {HERE!r})\n"
    if limit_mb is not None:
        prelude += f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit_mb} << 20, {limit_mb} << 20))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`create_app(engine, **kw)` served by uvicorn on a thread; with `net` (make_server's keyword arguments), by
    `mbd_rs.server.net.make_server` as `mbd-rs serve` does (header timeout, connection cap)."""

    def __init__(self, engine, net=None, **kw):
        import uvicorn

        from mbd_rs.server import create_app
        self.port = free_port()
        self.app = create_app(engine, **kw)
        if net is None:
            cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
            self.server = uvicorn.Server(cfg)
        else:
            from mbd_rs.server.net import make_server
            self.server = make_server(self.app, "127.0.0.1", self.port, log_level="error", **net)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_subprocess(args=(), env=None):
    """`mbd-rs serve` in a subprocess of this interpreter on a free port, with `args` (e.g. --model, --api-key);
    yields (base URL, served model name, the process) once /health answers, and stops it after."""
    import httpx
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mbd_rs", "serve", "--port", str(port), *args],
                            cwd=os.path.dirname(HERE), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                r = httpx.get(base + "/health", timeout=5)
                if r.status_code == 200:
                    name = r.json()["model"]
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            assert time.time() < deadline, "server did not become healthy in 90 s"
            time.sleep(0.1)
        yield base, name, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def copy_model(src, dst, edit_config=None):
    """The model directory `src` copied to `dst` (made, or an empty directory), its config.json edited in place by
    `edit_config(cfg)`; returns dst."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if edit_config is not None:
        p = os.path.join(dst, "config.json")
        with open(p) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(p, "w") as f:
            json.dump(cfg, f)
    return dst


@pytest.fixture
def model_copy(tmp_path):
    """Copy a parity fixture into a temp dir so a test can edit or break it."""

    def make(name="qwen3_headdim_gqa", edit_config=None):
        return copy_model(parity_dir(name), tmp_path / name, edit_config)

    return make


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory):
    """The embedded model with a 131072-token context, as every real checkpoint has 32k-128k (for long-request
    tests: cancellation, interrupts, request caps)."""
    import mbd_rs
    return str(copy_model(mbd_rs.DEFAULT_MODEL, tmp_path_factory.mktemp("long_context"),
                          lambda c: c.update(max_position_embeddings=131072)))


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """The embedded model given a Hermes-style chat template that renders tools (tests/fixtures/tools/) and a
    2048-token context (the tools' definitions take some 500 of its tokens). It was never taught tools: a test can
    check that its calls are valid, not that they are right."""
    import mbd_rs
    dst = copy_model(mbd_rs.DEFAULT_MODEL, tmp_path_factory.mktemp("tool_model"),
                     lambda c: c.update(max_position_embeddings=2048))
    shutil.copy(os.path.join(HERE, "fixtures", "tools", "chat_template.jinja"), os.path.join(dst, "chat_template.jinja"))
    return str(dst)


def run_concurrently(fn, args_list, timeout=120):
    """fn(*args) for every args of args_list, each in its own thread, started together; their results in order."""
    import threading
    got = [None] * len(args_list)
    start = threading.Barrier(len(args_list))

    def work(i):
        start.wait()
        got[i] = fn(*args_list[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return got
