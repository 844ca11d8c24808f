"""How an install picks its compiled core (python/mbd_rs/_cuda_libs.py). The CUDA wheel carries the CPU core and a
CUDA build at mbd_rs/_cuda/_core.abi3.so; where the CUDA build cannot load (no driver, no cuBLAS) the package must
still import and run on the CPU, and device="cuda" must say why. Simulated on a copy of the installed package: the
CUDA slot holds a file that cannot load, or a loadable core."""
import os
import shutil
import subprocess
import sys

import mbd_rs

PKG = os.path.dirname(os.path.abspath(mbd_rs.__file__))
CPU_CORE = mbd_rs._core.__file__


def package_copy(tmp_path, cuda_core):
    """A copy of the installed package whose mbd_rs/_cuda/_core.abi3.so is `cuda_core` (bytes or a file path)."""
    dst = tmp_path / "site" / "mbd_rs"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("__pycache__", "_cuda"))
    (dst / "_cuda").mkdir()
    (dst / "_cuda" / "__init__.py").write_text("")
    if isinstance(cuda_core, bytes):
        (dst / "_cuda" / "_core.abi3.so").write_bytes(cuda_core)
    else:
        shutil.copy(cuda_core, dst / "_cuda" / "_core.abi3.so")
    return str(tmp_path / "site")


def run(site, code):
    env = {**os.environ, "PYTHONPATH": site}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_this_install_uses_the_core_it_can():
    """CPU wheel: its one core, CUDA available nowhere. CUDA wheel: the CUDA core, or the CPU core and the reason."""
    reason = mbd_rs._cuda_libs.cuda_unavailable
    if not os.path.exists(os.path.join(PKG, "_cuda", "_core.abi3.so")):
        assert mbd_rs._core.__name__ == "mbd_rs._core" and reason is None
    elif reason is None:
        assert mbd_rs._core.__name__ == "mbd_rs._cuda._core"
    else:
        assert mbd_rs._core.__name__ == "mbd_rs._core" and "lib" in reason, reason


def test_a_cuda_core_that_cannot_load_falls_back_to_the_cpu_core(tmp_path):
    site = package_copy(tmp_path, b"not a shared object")
    out = run(site, """
import mbd_rs
from mbd_rs import _cuda_libs
assert mbd_rs.__file__.startswith(%r), mbd_rs.__file__
assert mbd_rs._core.__file__.endswith("mbd_rs/_core.abi3.so"), mbd_rs._core.__file__
assert _cuda_libs.cuda_unavailable and "_core.abi3.so" in _cuda_libs.cuda_unavailable, _cuda_libs.cuda_unavailable
eng = mbd_rs.Engine.load(device="auto")
print(eng.info.device, eng.chat([{"role": "user", "content": "sort 3 1 2"}]).text)
try:
    mbd_rs.Engine.load(device="cuda")
except mbd_rs.UnsupportedArchitectureError as e:
    print("cuda:", e)
""" % site)
    lines = out.splitlines()
    assert lines[0] == "cpu 1 2 3", out
    assert lines[1].startswith("cuda: device 'cuda': this is the CUDA build of mbd-rs, but its CUDA core could not "
                               "be loaded:"), out
    assert "_core.abi3.so" in lines[1], out


def test_a_loadable_cuda_core_is_the_one_used(tmp_path):
    site = package_copy(tmp_path, CPU_CORE)  # a core that loads (here built without CUDA: only the choice is tested)
    out = run(site, """
import mbd_rs
from mbd_rs import _core, _cuda_libs, engine
assert _cuda_libs.cuda_unavailable is None
assert mbd_rs._core is _core is engine._core and _core.__name__ == "mbd_rs._cuda._core", _core.__name__
print(mbd_rs.Engine.load().chat([{"role": "user", "content": "sort 3 1 2"}]).text)
""")
    assert out.strip() == "1 2 3"
