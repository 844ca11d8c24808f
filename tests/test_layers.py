"""The floor plan of crates/mbd-core/src (docs/dev/architecture.md's `layers` block) holds, and its check can fail:
an upward import, a circle or a file outside every wing each turn scripts/check_layers.py red."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "crates", "mbd-core", "src")
CHECK = os.path.join(ROOT, "scripts", "check_layers.py")
PLAN = os.path.join(ROOT, "docs", "dev", "architecture.md")

pytestmark = [pytest.mark.source_tree,
              pytest.mark.skipif(not os.path.isdir(SRC), reason="needs the source tree (not an installed wheel)")]


def check(src: str = SRC) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECK, "--src", src, "--plan", PLAN, "--report"], capture_output=True,
                          text=True)


def test_the_tree_follows_its_floor_plan():
    r = check()
    assert r.returncode == 0, r.stderr
    assert "circles 0" in r.stdout and "upward or sideways references 0" in r.stdout


@pytest.mark.parametrize("case", ["upward", "sideways", "circle", "outside", "super", "glob"])
def test_the_check_fails_on_a_broken_plan(tmp_path, case):
    src = str(tmp_path / "src")
    shutil.copytree(SRC, src)

    def add(path: str, line: str) -> None:
        p = os.path.join(src, path)
        with open(p, encoding="utf-8") as f:
            text = f.read()
        with open(p, "w", encoding="utf-8") as f:
            f.write(line + "\n" + text)

    if case == "upward":  # a kernel reaching up into the net wing
        add("kernels/skinny.rs", "use crate::net::linear::Matrix;")
        want = re.compile(r"kernels/skinny \(kernels, floor \d+\) refers upward to net/linear \(net, floor \d+\)")
    elif case == "sideways":  # two files of one floor
        add("kernels/panels/mod.rs", "use crate::kernels::qdot::DotMatrix;")
        want = "refers sideways (same floor) to kernels/qdot/mod"
    elif case == "circle":  # the scheduler's vocabulary pulled down into params, closing a loop
        add("params/request.rs", "use crate::generate::scheduler::Scheduler;")
        want = "circle"
    elif case == "outside":  # a new file on no floor
        with open(os.path.join(src, "kernels", "extra.rs"), "w") as f:
            f.write("pub fn f() {}\n")
        want = "kernels/extra is outside every wing"
    elif case == "glob":  # a folder's module reached through `super::*` (as a macro's inline module does too)
        add("net/mask.rs", "use super::*;")
        want = re.compile(r"net/mask \(net, floor \d+\) refers sideways \(same floor\) to net/mod \(net, floor \d+\)")
    else:  # a sibling reached through super::
        add("net/kv_cache.rs", "use super::linear::Matrix;")
        want = re.compile(r"net/kv_cache \(net, floor \d+\) refers upward to net/linear \(net, floor \d+\)")
    r = check(src)
    assert r.returncode == 1, r.stdout + r.stderr
    assert (want.search(r.stderr) if isinstance(want, re.Pattern) else want in r.stderr), r.stderr
