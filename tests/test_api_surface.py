"""The Python surface derived from the core, checked against it: `ModelInfo`'s fields are the core's
(`_core.MODEL_INFO_FIELDS`, from crates/mbd-core/src/model/info.rs), `_core.pyi` names exactly what the extension
has (module attributes, classes, methods and their arguments), and Engine.load's options are the core's registry."""
import ast
import dataclasses
import inspect
import os

import pytest

import mbd_rs
from mbd_rs import _core

STUB = os.path.join(os.path.dirname(mbd_rs.__file__), "_core.pyi")


def test_model_info_is_the_cores():
    fields = [(f.name, f.type) for f in dataclasses.fields(mbd_rs.ModelInfo)]
    assert fields == [tuple(x) for x in _core.MODEL_INFO_FIELDS]
    info = _core.CoreEngine.load(mbd_rs.DEFAULT_MODEL).info()
    assert list(info) == [n for n, _ in _core.MODEL_INFO_FIELDS]
    assert mbd_rs.Engine.load().info.max_context == info["max_context"]


def _stub() -> ast.Module:
    with open(STUB, encoding="utf-8") as f:
        return ast.parse(f.read())


def test_stub_names_every_module_attribute():
    tree = _stub()
    stubbed = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    stubbed |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    runtime = {n for n in dir(_core) if not n.startswith("_") or n == "__version__"}
    assert stubbed == runtime


@pytest.mark.parametrize("cls", [n for n in dir(_core) if n.startswith("Core")])
def test_stub_methods_and_arguments_are_the_extensions(cls):
    node = next(n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name == cls)
    def is_property(f: ast.FunctionDef) -> bool:
        return any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)

    funcs = [f for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    stub = {f.name: [a.arg for a in f.args.args if a.arg != "self"] for f in funcs if not is_property(f)}
    stub_props = {f.name for f in funcs if is_property(f)}
    klass = getattr(_core, cls)
    runtime, props = {}, set()
    for name in dir(klass):
        if name.startswith("_"):
            continue
        attr = getattr(klass, name)
        if not callable(attr):
            props.add(name)
            continue
        params = inspect.signature(attr).parameters
        runtime[name] = [p for p in params if p not in ("self", "$self")]
    assert stub == runtime
    assert stub_props == props


def test_load_options_are_the_registry():
    assert mbd_rs.LOAD_OPTIONS == mbd_rs.LOAD_PARAMS + mbd_rs.PROFILE_OVERRIDES + mbd_rs.KERNEL_SWITCHES
    assert all(n in mbd_rs.PARAMS for n in mbd_rs.LOAD_OPTIONS)
    # Engine.load's docstring lists every load option and profile override, from the registry
    doc = mbd_rs.Engine.load.__doc__ or ""
    for name in mbd_rs.LOAD_PARAMS + mbd_rs.PROFILE_OVERRIDES:
        assert f"{name}: {mbd_rs.PARAMS[name]['help'][:20]}" in doc, name
    with pytest.raises(TypeError, match="unexpected profile override 'devcie'.*other load options are device"):
        mbd_rs.Engine.load(devcie="cpu")
    # a kernel switch by name, and as _kernels (benchmarks), load alike
    a = mbd_rs.Engine.load(stack=False, device="cpu")
    b = mbd_rs.Engine.load(_kernels=dict(stack=False), device="cpu")
    ids = a.tokenize("sort 3 1 2")
    assert (a.logits(ids) == b.logits(ids)).all()
    # the CUDA switches are accepted everywhere; on the CPU no graph is made and nothing changes
    c = mbd_rs.Engine.load(_kernels=dict(cuda_segments=True, cuda_graphs=True), device="cpu")
    assert (a.logits(ids) == c.logits(ids)).all()
    assert c.generate("sort 3 1 2", max_tokens=8).text == a.generate("sort 3 1 2", max_tokens=8).text
    assert c.graph_stats == (0, 0, 0) and a.graph_stats == (0, 0, 0)
