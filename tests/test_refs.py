"""scripts/check_refs.py finds each kind of dead reference it is for, planted in a small git tree of its own, and
passes the same tree clean."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "scripts", "check_refs.py")
pytestmark = [pytest.mark.source_tree, pytest.mark.skipif(not os.path.isfile(CHECK), reason="needs the source tree")]


def tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return str(tmp_path)


def check(root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECK, "--root", root], capture_output=True, text=True, timeout=60)


ISSUE, SESSION = "iss" + "ue", "sess" + "ion"
CLEAN = {
    "docs/a.md": "# Page A\n\n## The part\n\nSee [b](b.md#the-other-part), [here](#the-part) and `docs/b.md`.\n",
    "docs/b.md": "# Page B\n\n## The other part\n",
    "src/x.rs": "//! Read docs/a.md; the kernel is in src/x.rs.\n",
}


def test_a_clean_tree_passes(tmp_path):
    r = check(tree(tmp_path, CLEAN))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "plant, want",
    [
        # (spelt in pieces, so that this file holds no work item itself)
        ("// as " + ISSUE + " #12 decided\n", "numbered work item '" + ISSUE + " #12'"),
        ("# measured in " + SESSION + " 30\n", "numbered work item '" + SESSION + " 30'"),
        ("see results/" + SESSION + "28/x.json\n", "numbered work item '" + SESSION + "28'"),
        ("as decided (#55)\n", "numbered work item '#55'"),
        ("the bench is benches/gone.py\n", "'benches/gone.py' is not a file or folder"),
        ("[b](missing.md)\n", "'docs/missing.md' is not a file or folder"),
        ("[b](b.md#no-such-part)\n", "docs/b.md has no heading with the id 'no-such-part'"),
    ],
)
def test_each_kind_of_dead_reference_fails(tmp_path, plant, want):
    files = dict(CLEAN)
    files["docs/c.md"] = "# C\n\n" + plant
    r = check(tree(tmp_path, files))
    assert r.returncode == 1, r.stdout
    assert want in r.stdout, r.stdout
