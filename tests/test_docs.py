"""The manual's generated parts are current: docs/parameters.md and python/mbd_rs/params.py (the typed keyword
arguments) are what scripts/gen_param_docs.py writes from the core's registry (#55)."""
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


def test_typed_params_name_every_registry_parameter():
    import typing

    import mbd_rs
    from mbd_rs import params
    groups = {"GenerationParams": mbd_rs.GENERATION_PARAMS, "LogitsParams": mbd_rs.LOGITS_PARAMS,
              "ScoreParams": mbd_rs.SCORE_PARAMS, "LoadParams": mbd_rs.LOAD_OPTIONS}
    for name, names in groups.items():
        assert list(typing.get_type_hints(getattr(params, name))) == list(names), name
    # the engine's calls take them (IDEs and help() see the names)
    assert "GenerationParams" in str(mbd_rs.Engine.generate.__annotations__["params"])
