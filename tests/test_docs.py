"""The manual's generated parts are current: docs/parameters.md and python/mbd_rs/params.py (the typed keyword
arguments) are what scripts/gen_param_docs.py writes from the core's registry. And the product is described in one
sentence, the same wherever it is described."""
import ast
import os
import re
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


def test_the_product_is_described_in_one_sentence():
    """README's opening, pyproject's and mbd-core's descriptions, the CLI's help and the package's docstring."""
    def read(*parts):
        with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
            return f.read()

    def description(toml):
        (d,) = re.findall(r'^description = "(.*)"$', toml, re.M)
        return d

    readme = read("README.md").split("\n\n")[1]  # the paragraph under the title
    readme = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", readme)  # a link's text
    cli = ast.parse(read("python", "mbd_rs", "cli.py"))
    (help_text,) = [ast.literal_eval(k.value) for node in ast.walk(cli) if isinstance(node, ast.Call)
                    and any(k.arg == "prog" and ast.literal_eval(k.value) == "mbd-rs" for k in node.keywords)
                    for k in node.keywords if k.arg == "description"]
    said = {
        "README.md": readme,
        "pyproject.toml": description(read("pyproject.toml")),
        "crates/mbd-core/Cargo.toml": description(read("crates", "mbd-core", "Cargo.toml")),
        "mbd-rs --help": help_text,
        "mbd_rs.__doc__": ast.get_docstring(ast.parse(read("python", "mbd_rs", "__init__.py"))),
    }
    said = {where: " ".join(text.split()) for where, text in said.items()}
    assert len(set(said.values())) == 1, said
