"""The live web view (`mbd-rs serve` serves it at /), in a real browser: headless Chromium, driven over the DevTools
protocol (its --remote-debugging-pipe, no extra package), loads the page from a live server on 127.0.0.1, clicks Run,
and the test reads the resulting DOM (answer, forwards, blocks) and takes a screenshot; the recorded run replays one
forward at a time and the slider redraws any forward (checked against the engine's own trace), the end-of-text fill
is collapsed, empty fields show the family's defaults, and a failed run clears the last one's statistics. A page of
another origin that frames the view with `?prompt=...&run=1` must not make the server generate (docs/security.md: the
view runs only on a click, and no page may frame it). Skipped, saying so, where no Chromium is installed (.ci/run
installs Debian's)."""
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
def engine():
    return mbd_rs.Engine.load()


@pytest.fixture(scope="module")
def server(engine):
    from conftest import Server
    s = Server(engine, api_key=KEY, max_concurrency=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(engine):
    """A key-less server that checks Host, as `mbd-rs serve` on 127.0.0.1 runs."""
    from mbd_rs.server.net import allowed_hosts
    from conftest import Server
    s = Server(engine, max_concurrency=2, allowed_hosts=allowed_hosts("127.0.0.1"))
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
        assert "exceptionDetails" not in r, (expression, r["exceptionDetails"])
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


# the run is over and its slow-motion replay (on by default) has played to the end
FINISHED = "document.body.dataset.done === '1' && document.body.dataset.replaying !== '1'"


def cells(browser):
    """The canvas' token cells as drawn, in order ('·' masked, 'end' the end of the text), spaces dropped."""
    return [c for c in browser.eval("[...document.querySelectorAll('#canvas .cell')].map((c) => c.textContent)")
            if c.strip()]


def text(browser, element_id):
    return browser.eval(f"document.getElementById({json.dumps(element_id)}).textContent")


def browse(url, *extra):
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--virtual-time-budget=15000", *extra, url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_page_decodes_a_prompt_on_a_click_and_draws_the_blocks(server, engine, browser, tmp_path):
    prompt = "sort 5 3 8 1 9 2"
    want = engine.chat([{"role": "user", "content": prompt}], max_tokens=48, block_size=4)
    url = f"{server.base}/?" + urllib.parse.urlencode({"prompt": prompt, "key": KEY})
    browser.open(url)
    time.sleep(0.5)
    assert browser.eval("document.body.dataset.done") in (None, "")  # nothing runs until Run is clicked
    assert browser.eval("document.getElementById('prompt').value") == prompt
    browser.click("#run")
    browser.wait(FINISHED, timeout=60)
    dom = browser.eval("document.documentElement.outerHTML")
    assert re.search(r'id="error">\s*<', dom), "the page reported an error"
    assert re.search(r'id="answer">([^<]*)<', dom).group(1) == want.text
    assert int(re.search(r'id="forwards">(\d+)<', dom).group(1)) == want.usage.forward_passes
    blocks = re.findall(r'class="block (\w+)"', dom)
    assert blocks.count("completed") >= 2
    assert set(blocks) <= {"inactive", "activated", "fully_activated", "completed", "tail"}
    # the canvas spells the answer, then marks its end
    drawn = cells(browser)
    assert drawn[-1] == "end" and "".join(drawn[:-1]) == want.text.replace(" ", "")
    shot = tmp_path / "web.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_is_served_without_the_key_and_reports_errors(server, browser):
    browser.open(f"{server.base}/?" + urllib.parse.urlencode({"prompt": "hi", "key": "wrong"}))
    browser.click("#run")
    browser.wait(FINISHED, timeout=60)
    assert "invalid or missing API key" in text(browser, "error")


def _steps(engine, prompt, **kw):
    return [c.step for c in engine.stream_chat([{"role": "user", "content": prompt}], max_tokens=48,
                                               trace="canvas", **kw) if c.step]


def test_replay_plays_the_recorded_run_one_forward_at_a_time(server, engine, browser):
    """Before: a run of the embedded model lasted 30-60 ms and the view showed only its last state. Now the run is
    recorded, replayed at a chosen pace (one forward per tick, the answer growing as it did), and any forward can be
    drawn again from the slider."""
    prompt = "hello Grace"
    want = _steps(engine, prompt)
    assert len(want) >= 4  # enough forwards to watch
    browser.open(f"{server.base}/?" + urllib.parse.urlencode({"prompt": prompt, "key": KEY}))
    browser.eval("document.getElementById('slow').checked = false")  # no replay after this run
    browser.click("#run")
    browser.wait("document.body.dataset.done === '1'", timeout=60)
    assert browser.eval("document.body.dataset.replaying") in (None, "")
    assert int(text(browser, "forwards")) == len(want)
    assert text(browser, "stepinfo") == f"forward {len(want)} of {len(want)}"
    # replay at 0.1 s per forward, recording every value the forward counter shows
    browser.eval("""document.getElementById('pace').value = '100';
        window.seen = [];
        new MutationObserver(() => window.seen.push(document.getElementById('forwards').textContent))
          .observe(document.getElementById('forwards'), {childList: true, characterData: true, subtree: true});""")
    t0 = time.time()
    browser.click("#replay")
    browser.wait("document.body.dataset.replaying !== '1'", timeout=30)
    elapsed = time.time() - t0
    seen = [int(x) for x in browser.eval("window.seen")]
    assert [k for i, k in enumerate(seen) if i == 0 or seen[i - 1] != k] == list(range(1, len(want) + 1))
    assert elapsed >= 0.1 * (len(want) - 1) * 0.9, elapsed  # paced, not all at once
    # the slider draws forward k: its canvas, as the engine traced it, up to the end of the text
    eos = set(engine.info.eos_token_ids)
    for k in range(1, len(want) + 1):
        browser.eval(f"""{{ const s = document.getElementById('scrub'); s.value = {k};
            s.dispatchEvent(new Event('input')); }}""")
        assert int(text(browser, "forwards")) == k
        canvas = want[k - 1].canvas
        end = next((i for i, t in enumerate(canvas) if t in eos), None)
        shown = [t for t in canvas[:None if end is None else end]]
        pieces = [engine.detokenize([t]) if t >= 0 else "·" for t in shown]
        drawn = cells(browser)
        if end is not None:
            assert drawn[-1] == "end"
            drawn = drawn[:-1]
        # masked positions of blocks not yet created are summarised, not drawn: compare the drawn prefix
        assert [p for p in pieces if p.strip()][:len(drawn)] == drawn
        assert "".join(p for p in pieces if p != "·").startswith(text(browser, "answer"))


def test_the_end_of_text_fill_is_collapsed(server, engine, browser):
    """Before: every token the decoder wrote after the end of the text was drawn, each as its full special-token
    text ("<|endoftext|>"), flooding the canvas. Now the end is one small cell and the rest one line, its counts
    those of the engine's trace."""
    prompt = "hello Grace"
    last = _steps(engine, prompt)[-1].canvas
    eos = set(engine.info.eos_token_ids)
    end = next(i for i, t in enumerate(last) if t in eos)
    fill = sum(t >= 0 for t in last[end + 1:])
    never = sum(t < 0 for t in last[end + 1:])
    assert fill + never > 0
    browser.open(f"{server.base}/?" + urllib.parse.urlencode({"prompt": prompt, "key": KEY}))
    browser.click("#run")
    browser.wait(FINISHED, timeout=60)
    drawn = cells(browser)
    assert drawn.count("end") == 1 and drawn[-1] == "end"
    assert not any(c.startswith("<|") for c in drawn)
    assert text(browser, "tail") == (f"after the end: {fill} fill token{'' if fill == 1 else 's'} decoded, "
                                     f"{never} position{'' if never == 1 else 's'} never decoded")


def test_empty_fields_show_the_family_defaults(server, engine, browser):
    """Before: the τ/α/β fields and the policy said 'family', unexplained. Now they show the model family's
    defaults (ModelInfo.default_*), and a line says what an empty field decodes with."""
    i = engine.info
    browser.open(f"{server.base}/")
    for field, value in [("threshold", i.default_threshold), ("block_add_threshold", i.default_block_add_threshold),
                         ("decoded_token_threshold", i.default_decoded_token_threshold),
                         ("block_size", i.block_size)]:
        assert float(browser.eval(f"document.getElementById('{field}').placeholder")) == value, field
        assert browser.eval(f"document.getElementById('{field}').value") == ""
    assert text(browser, "policy_default") == i.default_acceptance
    note = text(browser, "defaults")
    assert f"{i.family} family's defaults" in note and f"{i.default_acceptance} acceptance" in note
    assert "family" not in "".join(browser.eval(
        "[...document.querySelectorAll('input')].map((x) => x.placeholder)"))


def test_a_failed_run_clears_the_last_runs_statistics(server, browser):
    """Before: a run that failed left the previous run's forwards, tokens/forward, blocks and canvas up, as if
    they were its own."""
    browser.open(f"{server.base}/?" + urllib.parse.urlencode({"prompt": "sort 3 1 2", "key": KEY}))
    browser.click("#run")
    browser.wait(FINISHED, timeout=60)
    assert int(text(browser, "forwards")) > 0 and cells(browser)
    browser.eval("document.getElementById('key').value = 'wrong'")
    browser.click("#run")
    browser.wait(FINISHED, timeout=60)
    assert "invalid or missing API key" in text(browser, "error")
    assert (text(browser, "forwards"), text(browser, "tpf"), text(browser, "tps"), text(browser, "nblocks")) == \
        ("0", "–", "–", "0")
    assert cells(browser) == [] and text(browser, "answer") == ""
    assert browser.eval("document.getElementById('player').hidden")


def test_a_link_does_not_make_the_server_generate(open_server, caplog):
    """Before: /?prompt=...&run=1 ran the prompt on load, so any link (or a page of another origin) made a
    key-less server generate."""
    url = f"{open_server.base}/?" + urllib.parse.urlencode({"prompt": "sort 3 1 2", "run": 1, "sync": 1})
    with caplog.at_level(logging.INFO, logger="mbd_rs.server"):
        dom = browse(url, "--dump-dom")
    assert 'id="run"' in dom
    assert any(" GET / " in line for line in caplog.messages), caplog.messages
    assert not any("/v1/" in line for line in caplog.messages), caplog.messages


class _Attacker(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args):
        pass


def test_a_page_of_another_origin_cannot_drive_the_server_through_a_frame(open_server, caplog):
    """Before: a page of another origin framing /?prompt=...&run=1 made the key-less server generate (undoing the
    JSON-only rule against cross-site posts). Now the view is not framed (X-Frame-Options: DENY, CSP
    frame-ancestors 'none') and runs only on a click; the server sees the frame's GET and nothing more."""
    target = f"{open_server.base}/?" + urllib.parse.urlencode({"prompt": "sort 3 1 2", "run": 1})
    _Attacker.page = (f'<html><body><h1>cute cats</h1><iframe src="{target}" width="900" height="500">'
                      '</iframe></body></html>').encode()
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with caplog.at_level(logging.INFO, logger="mbd_rs.server"):
            # another origin: another host name and port
            dom = browse(f"http://localhost:{evil.server_address[1]}/", "--dump-dom")
            time.sleep(0.5)
    finally:
        evil.shutdown()
    assert "cute cats" in dom
    assert any(" GET / " in line for line in caplog.messages), caplog.messages  # the frame was requested ...
    assert not any("/v1/" in line for line in caplog.messages), caplog.messages  # ... and generated nothing
    assert open_server.app.state.slots.active == 0
