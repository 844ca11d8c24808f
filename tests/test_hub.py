"""Hugging Face Hub ids ("org/name") resolved through the local Hub cache: a hand-built cache in the layout
huggingface_hub writes (blobs/, snapshots/<commit>/ symlinks, refs/<name>), used offline (HF_HUB_OFFLINE=1) or with
the network refused. No test reaches the Hub."""

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

hf_constants = pytest.importorskip(
    "huggingface_hub.constants", reason="huggingface_hub is not installed (pip install huggingface_hub)")

from mbd_rs import Engine, InvalidRequestError, ModelFileNotFoundError  # noqa: E402
from mbd_rs.hub import DEFAULT_MODEL, is_hub_id, resolve_model_path  # noqa: E402

REPO = "mbd-org/mbd-tiny-hub"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
MESSAGES = [{"role": "user", "content": "What is 3 plus 4?"}]


def build_cache(cache, repo=REPO, commit=COMMIT, refs=("main",)):
    """models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<ref>}."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in FILES:
        data = open(os.path.join(DEFAULT_MODEL, name), "rb").read()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file verbatim
    return str(snap)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An offline Hub cache holding REPO; huggingface_hub reads these variables at import, so patch both."""
    cache = tmp_path / "hub"
    snap = build_cache(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache, snap


@pytest.fixture(scope="module")
def embedded_answer():
    return Engine.load().chat(MESSAGES, max_tokens=16).text


def test_hub_id_shape(tmp_path, monkeypatch):
    assert is_hub_id("org/name") and is_hub_id("JetLM/SDAR-1.7B-Chat") and is_hub_id("a_b/c.d-e")
    for path in ["name", "./org/name", "/org/name", "org/name/sub", ".org/name", "org/", "/", "org/na me"]:
        assert not is_hub_id(path), path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing local directory wins over the Hub
    assert resolve_model_path("org/name") == "org/name"
    assert resolve_model_path(None) == DEFAULT_MODEL
    with pytest.raises(InvalidRequestError, match="revision='v1' applies only to Hugging Face Hub ids"):
        resolve_model_path("org/name", "v1")


def test_load_hub_id_from_offline_cache(offline_cache, embedded_answer):
    _, snap = offline_cache
    eng = Engine.load(REPO)
    assert eng.info.family == "mbd-tiny"
    assert os.path.realpath(eng.info.path) == os.path.realpath(snap)
    assert eng.chat(MESSAGES, max_tokens=16).text == embedded_answer


def test_revision_branch_tag_and_commit(offline_cache, tmp_path):
    cache, snap = offline_cache
    root = cache / ("models--" + REPO.replace("/", "--"))
    (root / "refs" / "v1").write_text(COMMIT)
    for rev in ["main", "v1", COMMIT]:
        assert os.path.realpath(resolve_model_path(REPO, rev)) == os.path.realpath(snap)
    assert Engine.load(REPO, revision="v1").info.family == "mbd-tiny"


@pytest.mark.parametrize("revision", ["no-such-branch", "f" * 40])
def test_missing_revision_fails_clearly(offline_cache, revision):
    with pytest.raises(ModelFileNotFoundError) as ei:
        Engine.load(REPO, revision=revision)
    msg = str(ei.value)
    assert REPO in msg and repr(revision) in msg and "neither a local directory nor in the Hugging Face cache" in msg
    assert ei.value.filename == REPO and isinstance(ei.value, FileNotFoundError)


def test_unknown_id_offline(offline_cache):
    cache, _ = offline_cache
    with pytest.raises(ModelFileNotFoundError) as ei:
        Engine.load("nobody/no-such-model")
    msg = str(ei.value)
    assert "'nobody/no-such-model' is neither a local directory nor in the Hugging Face cache" in msg
    assert str(cache) in msg and "LocalEntryNotFoundError" in msg  # the hub's own reason, briefly


def test_missing_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` now raises ImportError
    with pytest.raises(ModelFileNotFoundError, match="pip install huggingface_hub"):
        Engine.load("org/name")


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "mbd_rs", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture
def refused_env(tmp_path):
    """Environment variables only (a fresh process reads them at import): online mode, but the Hub endpoint is a
    closed port on this machine, so every request is refused."""
    cache = tmp_path / "hub"
    build_cache(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="0",
               HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HUB_DISABLE_TELEMETRY="1")
    return env


def test_cli_network_refused_uses_cache(refused_env):
    r = _cli(["info", REPO, "--json"], refused_env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["family"] == "mbd-tiny"
    r = _cli(["generate", "--model", REPO, "--revision", "main", "--chat", "--max-tokens", "16",
              MESSAGES[0]["content"]], refused_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == Engine.load().chat(MESSAGES, max_tokens=16).text.strip()


def test_cli_network_refused_unknown_id(refused_env):
    r = _cli(["info", "nobody/no-such-model"], refused_env)
    errors = [line for line in r.stderr.splitlines() if not line.startswith("mbd-rs: loading ")]  # the load's lines
    assert r.returncode == 2 and errors[0].startswith("mbd-rs: cannot load:"), r.stderr
    assert "'nobody/no-such-model' is neither a local directory nor in the Hugging Face cache" in r.stderr
    r = _cli(["info", REPO, "--revision", "no-such-branch"], refused_env)
    assert r.returncode == 2 and "(revision 'no-such-branch')" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ load progress


def _tensor_bytes(model_dir):
    """The tensors' data bytes of a model directory's safetensors files, from their headers."""
    import glob
    import struct
    total = 0
    for p in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def test_load_progress_callback_counts_the_checkpoint_bytes():
    seen = []
    Engine.load(progress=lambda done, total: seen.append((done, total)))
    total = _tensor_bytes(DEFAULT_MODEL)
    assert len(seen) > 10 and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total

    def broken(done, total):
        raise RuntimeError("a progress callback that fails")
    assert Engine.load(progress=broken).generate("hi", max_tokens=2).usage.completion_tokens >= 0  # load goes on


@pytest.mark.parametrize("progress,shown", [("True", True), ("None", False), ("False", False)])
def test_load_progress_bar(progress, shown):
    """progress=True draws a tqdm bar on stderr; the default draws none when stderr is not a terminal (or for a
    checkpoint under 256 MB); False never."""
    pytest.importorskip("tqdm")
    code = f"import mbd_rs; mbd_rs.Engine.load(progress={progress})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("loading weights" in r.stderr) == shown, r.stderr
