"""The live web view (`mbd-rs serve` serves it at /), in a real browser: headless Chromium, driven over the DevTools
protocol (its --remote-debugging-pipe, no extra package), loads the page from a live server on 127.0.0.1, clicks Run,
and the test reads the resulting DOM (answer, forwards, blocks) and takes a screenshot. A page of another origin
that frames the view with `?prompt=...&run=1` must not make the server generate (issue #54: the view runs only on a
click, and no page may frame it). Skipped, saying so, where no Chromium is installed (.ci/run installs Debian's)."""
import base64
import http.server
import json
import logging
import os
import re
import select
import shutil
import subprocess
import threading
import time
import urllib.parse

import pytest

import mbd_rs

pytest.importorskip("uvicorn")
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")
KEY = "sk-web"


@pytest.fixture(scope="module")
def server():
    from test_server import Server
    s = Server(mbd_rs.Engine.load(), api_key=KEY, max_concurrency=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server():
    """A key-less server that checks Host, as `mbd-rs serve` on 127.0.0.1 runs."""
    from mbd_rs.server.net import allowed_hosts
    from test_server import Server
    s = Server(mbd_rs.Engine.load(), max_concurrency=2, allowed_hosts=allowed_hosts("127.0.0.1"))
    yield s
    s.stop()


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (fd 3: commands, fd 4: replies; JSON, NUL-ended)."""

    def __init__(self):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child():  # the pipe ends at the fds Chromium reads and writes
            os.dup2(cmd_r, 3)
            os.dup2(out_w, 4)

        self.p = subprocess.Popen([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                   "--remote-debugging-pipe", "--window-size=1100,600", "about:blank"],
                                  preexec_fn=child, close_fds=False, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def send(self, method, session=None, timeout=60, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._out_r], [], [], max(0.0, deadline - time.time()))
                assert ready, f"no reply to {method} in {timeout} s"
                chunk = os.read(self._out_r, 1 << 20)
                assert chunk, "Chromium closed its pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def eval(self, expression):
        r = self.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True, awaitPromise=True)
        return r["result"].get("value")

    def open(self, url, timeout=30):
        self.send("Page.navigate", self.session, url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def wait(self, condition, timeout=30):
        deadline = time.time() + timeout
        while not self.eval(condition):
            assert time.time() < deadline, f"timed out waiting for {condition}"
            time.sleep(0.05)

    def click(self, selector):
        """A real mouse click (a trusted event) in the middle of the element."""
        box = self.eval(f"JSON.stringify(document.querySelector({json.dumps(selector)}).getBoundingClientRect())")
        r = json.loads(box)
        x, y = r["x"] + r["width"] / 2, r["y"] + r["height"] / 2
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", self.session, type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", self.session, format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)


@pytest.fixture
def browser():
    b = Browser()
    yield b
    b.close()


def browse(url, *extra):
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--virtual-time-budget=15000", *extra, url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


class AccessLog(logging.Handler):
    """The server's access log lines ("mbd_rs.server"), as they come."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        log = logging.getLogger("mbd_rs.server")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc):
        log = logging.getLogger("mbd_rs.server")
        log.removeHandler(self)
        log.setLevel(self._level)


def test_page_decodes_a_prompt_on_a_click_and_draws_the_blocks(server, browser, tmp_path):
    prompt = "sort 5 3 8 1 9 2"
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": prompt}], max_tokens=48, block_size=4)
    url = f"{server.base}/?" + urllib.parse.urlencode({"prompt": prompt, "key": KEY})
    browser.open(url)
    time.sleep(0.5)
    assert browser.eval("document.body.dataset.done") in (None, "")  # nothing runs until Run is clicked
    assert browser.eval("document.getElementById('prompt').value") == prompt
    browser.click("#run")
    browser.wait("document.body.dataset.done === '1'", timeout=60)
    dom = browser.eval("document.documentElement.outerHTML")
    assert re.search(r'id="error">\s*<', dom), "the page reported an error"
    assert re.search(r'id="answer">([^<]*)<', dom).group(1) == want.text
    assert int(re.search(r'id="forwards">(\d+)<', dom).group(1)) == want.usage.forward_passes
    blocks = re.findall(r'class="block (\w+)"', dom)
    assert blocks.count("completed") >= 2 and set(blocks) <= {"inactive", "activated", "fully_activated", "completed"}
    cells = re.findall(r'class="cell[^"]*"[^>]*>([^<]*)<', dom)
    # the canvas spells the answer (then the EOS fill)
    assert "".join(c for c in cells if c != "·" and not c.startswith("<|")).startswith(want.text)
    shot = tmp_path / "web.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_is_served_without_the_key_and_reports_errors(server, browser):
    browser.open(f"{server.base}/?" + urllib.parse.urlencode({"prompt": "hi", "key": "wrong"}))
    browser.click("#run")
    browser.wait("document.body.dataset.done === '1'", timeout=60)
    assert "invalid or missing API key" in browser.eval("document.getElementById('error').textContent")


def test_a_link_does_not_make_the_server_generate(open_server):
    """Before: /?prompt=...&run=1 ran the prompt on load, so any link (or a page of another origin) made a
    key-less server generate."""
    url = f"{open_server.base}/?" + urllib.parse.urlencode({"prompt": "sort 3 1 2", "run": 1, "sync": 1})
    with AccessLog() as log:
        dom = browse(url, "--dump-dom")
    assert 'id="run"' in dom
    assert any(" GET / " in line for line in log.lines), log.lines
    assert not any("/v1/" in line for line in log.lines), log.lines


class _Attacker(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args):
        pass


def test_a_page_of_another_origin_cannot_drive_the_server_through_a_frame(open_server):
    """Before: a page of another origin framing /?prompt=...&run=1 made the key-less server generate (undoing the
    JSON-only rule against cross-site posts). Now the view is not framed (X-Frame-Options: DENY, CSP
    frame-ancestors 'none') and runs only on a click; the server sees the frame's GET and nothing more."""
    target = f"{open_server.base}/?" + urllib.parse.urlencode({"prompt": "sort 3 1 2", "run": 1})
    _Attacker.page = (f'<html><body><h1>cute cats</h1><iframe src="{target}" width="900" height="500">'
                      '</iframe></body></html>').encode()
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with AccessLog() as log:
            # another origin: another host name and port
            dom = browse(f"http://localhost:{evil.server_address[1]}/", "--dump-dom")
            time.sleep(0.5)
    finally:
        evil.shutdown()
    assert "cute cats" in dom
    assert any(" GET / " in line for line in log.lines), log.lines  # the frame was requested ...
    assert not any("/v1/" in line for line in log.lines), log.lines  # ... and generated nothing
    assert open_server.app.state.slots.active == 0
