"""The manual's generated parts are current: docs/parameters.md is what scripts/gen_param_docs.py writes from the
core's registry (#55)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.source_tree,
              pytest.mark.skipif(not os.path.isfile(os.path.join(ROOT, "scripts", "gen_param_docs.py")),
                                 reason="needs the source tree")]


def test_parameter_table_is_generated_from_the_registry():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_param_docs.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(ROOT, "docs", "parameters.md"), encoding="utf-8") as f:
        text = f.read()
    import mbd_rs
    for name in mbd_rs.PARAMS:
        assert f"| `{name}` |" in text, name
