"""Which compiled core this install runs on.

The CPU wheel holds one extension, `mbd_rs._core`. The CUDA wheel (scripts/build-cuda-wheel.sh) holds the same CPU
extension plus a CUDA build of it at `mbd_rs._cuda._core`, linked to the NVIDIA driver (libcuda.so.1), cuBLAS and
cuRAND. The CUDA build is used when those libraries load; the CUDA libraries installed by pip's nvidia-* packages (as
torch uses them) are found without LD_LIBRARY_PATH. Where they do not load (no driver: a laptop, a CI runner), the
CPU extension is used instead, so the CUDA wheel imports everywhere, and `device="cuda"` explains why it cannot be
had (`cuda_unavailable`)."""
import ctypes
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Tuple

# Order matters: cublas needs cublasLt.
_LIBS = ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcurand.so.10", "libnvrtc.so.13"]
_SUBDIRS = ["cu13/lib", "cuda_runtime/lib", "cublas/lib", "curand/lib", "cuda_nvrtc/lib"]
_CUDA_CORE = "mbd_rs._cuda._core"

#: Why this install runs without CUDA although it is the CUDA build (the import error), or None.
cuda_unavailable: Optional[str] = None


def preload() -> list[str]:
    """Load the CUDA libraries of pip's nvidia-* packages globally (so the CUDA core's NEEDED entries resolve)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    loaded = []
    for lib in _LIBS:
        for root in roots:
            for sub in _SUBDIRS:
                path = os.path.join(root, sub, lib)
                if os.path.exists(path):
                    try:
                        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        continue
                    loaded.append(path)
                    break
            else:
                continue
            break
    return loaded


def import_core() -> Tuple[ModuleType, Optional[str]]:
    """The core to use, as `mbd_rs._core` (registered under that name), and why CUDA is unavailable (or None)."""
    try:
        core = importlib.import_module(_CUDA_CORE)
    except ModuleNotFoundError as e:
        if e.name not in ("mbd_rs._cuda", _CUDA_CORE):
            raise
        return importlib.import_module("mbd_rs._core"), None  # the CPU wheel: no CUDA build in it
    except ImportError as first:
        error = str(first)
        try:
            if not preload():
                raise first
            core = importlib.import_module(_CUDA_CORE)
        except ImportError as e:
            error = str(e)
            hint = ("the NVIDIA driver (libcuda.so.1) is not installed" if "libcuda.so" in error else
                    "install the CUDA 13 libraries: pip install nvidia-cublas nvidia-curand, or torch with CUDA 13")
            return importlib.import_module("mbd_rs._core"), f"{error} ({hint})"
    sys.modules["mbd_rs._core"] = core
    return core, None
