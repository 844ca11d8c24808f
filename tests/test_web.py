"""The live web view (`mbd-rs serve` serves it at /), in a real browser: headless Chromium loads the page from a
live server on 127.0.0.1, submits a prompt, and the test reads the resulting DOM (answer, forwards, blocks) and
takes a screenshot. Skipped, saying so, where no Chromium is installed (.ci/run installs Debian's)."""
import re
import shutil
import subprocess
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


def browse(url, *extra):
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--virtual-time-budget=30000", *extra, url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_page_decodes_a_prompt_and_draws_the_blocks(server, tmp_path):
    prompt = "sort 5 3 8 1 9 2"
    want = mbd_rs.Engine.load().chat([{"role": "user", "content": prompt}], max_tokens=48, block_size=4)
    # sync=1: the page reads the event stream in one synchronous request, so the DOM is final when dumped
    url = f"{server.base}/?" + urllib.parse.urlencode({"prompt": prompt, "run": 1, "sync": 1, "key": KEY})
    dom = browse(url, "--dump-dom")
    assert 'data-done="1"' in dom
    assert re.search(r'id="error">\s*<', dom), "the page reported an error"
    assert re.search(r'id="answer">([^<]*)<', dom).group(1) == want.text
    assert int(re.search(r'id="forwards">(\d+)<', dom).group(1)) == want.usage.forward_passes
    blocks = re.findall(r'class="block (\w+)"', dom)
    assert blocks.count("completed") >= 2 and set(blocks) <= {"inactive", "activated", "fully_activated", "completed"}
    cells = re.findall(r'class="cell[^"]*"[^>]*>([^<]*)<', dom)
    # the canvas spells the answer (then the EOS fill)
    assert "".join(c for c in cells if c != "·" and not c.startswith("<|")).startswith(want.text)
    shot = tmp_path / "web.png"
    browse(url, f"--screenshot={shot}", "--window-size=1100,600")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_is_served_without_the_key_and_reports_errors(server):
    url = f"{server.base}/?" + urllib.parse.urlencode({"prompt": "hi", "run": 1, "sync": 1, "key": "wrong"})
    dom = browse(url, "--dump-dom")
    assert "invalid or missing API key" in dom and 'data-done="1"' in dom
