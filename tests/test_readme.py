"""README.md's examples, executed: every command and snippet of the quick start, Python, command-line and server
sections runs against the embedded model, and every `# -> X` comment (what the README says it shows) must be in
its output. The benchmark commands need torch and large random checkpoints: only the files they name are checked."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
MBD = f"{sys.executable} -m mbd_rs"


def read(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def blocks(after_heading, lang, doc=None):
    """The `lang` code blocks of the README section (or `doc`'s) whose heading starts with `after_heading`."""
    text = README if doc is None else read(doc)
    section = text.split("\n## " + after_heading, 1)[1].split("\n## ", 1)[0] if after_heading else text
    return re.findall(r"```" + lang + r"\n(.*?)```", section, re.S)


def expectations(code):
    """What each `# -> X` comment says its line prints (X whole, numbers included)."""
    return [m.strip() for m in re.findall(r"# -> ([^\n]*?)(?:   \(.*)?$", code, re.M)]


NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"


def shows(want, out):
    """Whether `out` shows `want`: the same words, and every number of `want` within 2% (or 0.005) of the one at its
    place (a README says -1.6e-05 of -1.5998839e-05)."""
    parts = re.split(f"({NUMBER})", want)
    pattern = "".join(f"({NUMBER})" if i % 2 else r"\s+".join(map(re.escape, p.split(" ")))
                      for i, p in enumerate(parts))
    # every start not inside a number (matches may overlap: "46\n1 3" and "1 3")
    for m in re.finditer(rf"(?<![\d.])(?={pattern})", out):
        got = [float(g) for g in m.groups()]
        said = [float(n) for n in parts[1::2]]
        if all(abs(g - s) <= max(0.02 * abs(s), 0.005) for g, s in zip(got, said)):
            return True
    return False


def shell(line, stdin=None, env=None, timeout=180):
    cmd = re.sub(r"(^|\| )mbd-rs ", lambda m: m.group(1) + MBD + " ", line)
    return subprocess.run(["bash", "-c", cmd], input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def run_python(code, timeout=180):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_quick_start_runs_the_main_job():
    (code,) = blocks("Quick start", "bash")
    first = next(line for line in code.splitlines() if line.startswith("pip install . && "))
    r = shell(first.split("&& ", 1)[1])  # the package is installed already
    assert r.returncode == 0, r.stderr
    assert "1 2 4 7 9" in r.stdout and "step" in r.stdout  # the answer, and the forwards drawn


@pytest.mark.source_tree
def test_quick_start_test_command_exists():
    (code,) = blocks("Quick start", "bash")
    assert "bash scripts/test.sh" in code and os.path.exists(os.path.join(ROOT, "scripts", "test.sh"))


def test_python_example():
    (code,) = blocks("Python", "python")
    out = run_python(code)
    for want in expectations(code):
        assert shows(want, out), (want, out)
    assert len(expectations(code)) == 2


def test_python_api_doc_example():
    (code, *_) = blocks("", "python", doc="docs/python-api.md")
    out = run_python(code)
    for want in expectations(code):
        assert shows(want, out), (want, out)
    assert len(expectations(code)) == 5


def test_python_api_asyncio_example():
    (code,) = blocks("asyncio", "python", doc="docs/python-api.md")
    out = run_python(code)
    for want in expectations(code):
        assert shows(want, out), (want, out)
    assert len(expectations(code)) == 2


def test_structured_outputs_doc_example():
    pytest.importorskip("pydantic")
    (code, *_) = blocks("", "python", doc="docs/structured-outputs.md")
    out = run_python(code)
    for want in expectations(code):
        assert shows(want, out), (want, out)
    assert len(expectations(code)) == 4


def test_every_task_the_readme_names_is_solved():
    """The README's list of what the embedded model knows: each `prompt` → `answer` pair is answered so."""
    import mbd_rs
    section = README.split("\n## Python", 1)[1].split("\n## ", 1)[0]
    pairs = re.findall(r"`([^`]+)` → `([^`]+)`", section)
    assert len(pairs) >= 6, pairs
    eng = mbd_rs.Engine.load()
    for prompt, answer in pairs:
        assert eng.chat([{"role": "user", "content": prompt}], max_tokens=32).text == answer, prompt


def test_command_line_examples():
    (code,) = blocks("Command line", "bash")
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) == 7
    for line in lines:
        stdin = "sort 3 1 2\n/reset\n\n" if line.startswith("mbd-rs chat") else None
        r = shell(line.split("  #", 1)[0].strip(), stdin=stdin)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        for want in expectations(line):
            assert shows(want, r.stdout + r.stderr), (line, want, r.stdout)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def readme_server():
    pytest.importorskip("uvicorn")
    (code,) = blocks("OpenAI-compatible server", "bash")
    serve = next(line for line in code.splitlines() if line.startswith("mbd-rs serve"))
    port = _free_port()
    cmd = re.sub(r"--port \d+", f"--port {port}", serve.split("  #", 1)[0].strip())
    proc = subprocess.Popen(["bash", "-c", "exec " + cmd.replace("mbd-rs ", MBD + " ", 1)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import httpx
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    yield port
    proc.terminate()
    proc.wait(timeout=20)


def test_server_curl_example(readme_server):
    (code,) = blocks("OpenAI-compatible server", "bash")
    curl = code.split("mbd-rs serve", 1)[1].split("\n", 1)[1]
    curl = curl.split("\n# ->")[0].replace("localhost:8000", f"localhost:{readme_server}")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
    events = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    (want,) = re.findall(r"join to (.*)", code)
    assert text == want.strip() and r.stdout.rstrip().endswith("data: [DONE]")


def test_server_openai_client_example(readme_server):
    pytest.importorskip("openai")
    # the section's other python blocks (LiteLLM, LangChain) are run by tests/test_clients.py
    (code,) = [c for c in blocks("OpenAI-compatible server", "python") if "from openai import OpenAI" in c]
    out = run_python(code.replace("127.0.0.1:8000", f"127.0.0.1:{readme_server}"))
    assert out == expectations(code)[0]


@pytest.mark.source_tree
def test_benchmark_commands_name_real_files():
    (code,) = blocks("Benchmarks and GPU", "bash", doc="benches/README.md")
    for path in re.findall(r"(?:python |bash )?((?:benches|scripts)/[\w./-]+\.(?:py|sh))", code):
        assert os.path.exists(os.path.join(ROOT, path)), path
    for bench in re.findall(r"--bench (\w+)", code):
        assert os.path.exists(os.path.join(ROOT, "crates", "mbd-core", "benches", bench + ".rs")), bench


def test_install_section_matches_the_package_metadata():
    """The extras the Install section names are the installed distribution's, with its license and Python floor;
    `mbd-rs --version` is the distribution's version."""
    from importlib import metadata

    (code,) = blocks("Install", "bash")
    meta = metadata.metadata("mbd-rs")
    extras = set(meta.get_all("Provides-Extra") or [])
    named = set(re.findall(r"\[(\w+)\]", code + README.split("\n## Install", 1)[1].split("\n## ", 1)[0]))
    assert named and named <= extras, (named, extras)
    assert meta["Requires-Python"] == ">=3.10" and "3.10" in README.split("\n## Install", 1)[1][:2000]
    assert meta["License-Expression"] == "Apache-2.0"
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "--version"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == f"mbd-rs {metadata.version('mbd-rs')}", r.stdout
