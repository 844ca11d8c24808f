import json
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PARITY = os.path.join(HERE, "fixtures", "parity")


def pytest_configure(config):
    # Registered here (not in pyproject.toml) so that it holds where scripts/release-check.sh runs a copy of tests/.
    config.addinivalue_line("markers", "source_tree: needs the repository's files besides tests/ and README.md "
                            "(deselected when an installed wheel is tested)")


def parity_dir(name):
    return os.path.join(PARITY, name)


def load_cases():
    with open(os.path.join(PARITY, "cases.json")) as f:
        return json.load(f)


@pytest.fixture
def model_copy(tmp_path):
    """Copy a parity fixture into a temp dir so a test can edit or break it."""

    def make(name="qwen3_headdim_gqa", edit_config=None):
        dst = tmp_path / name
        shutil.copytree(parity_dir(name), dst)
        if edit_config is not None:
            p = dst / "config.json"
            cfg = json.loads(p.read_text())
            edit_config(cfg)
            p.write_text(json.dumps(cfg))
        return dst

    return make


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory):
    """The embedded model with a 131072-token context, as every real checkpoint has 32k-128k (for long-request
    tests: cancellation, interrupts, request caps)."""
    import mbd_rs
    d = tmp_path_factory.mktemp("long_context")
    for f in os.listdir(mbd_rs.DEFAULT_MODEL):
        shutil.copy(os.path.join(mbd_rs.DEFAULT_MODEL, f), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 131072
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)
