"""Every script in examples/ runs on the embedded model and says what its README line promises."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

pytestmark = [pytest.mark.source_tree,
              pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="needs the repository's examples/")]

EXPECT = {
    "stream_chat.py": ["1 2 4 7 9", "tokens/forward"],
    "decoding_modes.py": ["autoregressive", "'1 2 3 5 8 9'", "S2D2"],
    "batch_prompts.py": ["d c b a", "the same answers as alone: True"],
    "quantize.py": ["q8_0", "q4_k", "-> d c b a"],
    "cancel.py": ["stream: cancelled", "logits:"],
    "serve_and_query.py": ["1 3 5 9", "prompt_tokens"],
    "fastapi_app.py": ["-> d c b a", "streamed: sort 5 3 8 1 -> 1 3 5 8", "the same answers as alone: True"],
    "structured_outputs.py": ["Answer(numbers=[", "forced", "regex: '1 3 5 8'"],
}


def test_every_example_is_listed():
    scripts = {f for f in os.listdir(EXAMPLES) if f.endswith(".py")}
    assert scripts == set(EXPECT)
    with open(os.path.join(EXAMPLES, "README.md"), encoding="utf-8") as f:
        listed = f.read()
    assert all(f"`{s}`" in listed for s in scripts)


@pytest.mark.parametrize("script", sorted(EXPECT))
def test_example_runs(script):
    if script == "serve_and_query.py":
        pytest.importorskip("uvicorn")
    if script == "fastapi_app.py":
        pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for want in EXPECT[script]:
        assert want in r.stdout, (want, r.stdout)
    if script == "decoding_modes.py":  # the answers agree, diffusion takes fewer forwards than AR
        lines = {line.split("'")[0].strip(): line for line in r.stdout.splitlines()}
        fwd = {k: int(v.split("forwards")[0].split()[-1]) for k, v in lines.items()}
        assert fwd["multi-block diffusion"] < fwd["autoregressive"]
