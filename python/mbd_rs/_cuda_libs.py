"""Make the CUDA libraries installed by pip's nvidia-* packages (as torch uses them) visible to a CUDA build
of the extension, without LD_LIBRARY_PATH: load them globally before `_core` is imported."""
import ctypes
import importlib.util
import os

# Order matters: cublas needs cublasLt.
_LIBS = ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcurand.so.10", "libnvrtc.so.13"]
_SUBDIRS = ["cu13/lib", "cuda_runtime/lib", "cublas/lib", "curand/lib", "cuda_nvrtc/lib"]


def preload() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    loaded = []
    for lib in _LIBS:
        for root in roots:
            for sub in _SUBDIRS:
                path = os.path.join(root, sub, lib)
                if os.path.exists(path):
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    loaded.append(path)
                    break
            else:
                continue
            break
    return loaded
