"""mbd-rs: fast, exact inference for block-diffusion LLMs on the Qwen2/Qwen3 architectures."""
from . import errors

try:
    from ._core import __version__
except ImportError as _e:  # a CUDA build whose libraries come from pip's nvidia-* packages
    if not any(k in str(_e) for k in ("libcu", "libnvrtc")):
        raise
    from ._cuda_libs import preload as _preload

    if not _preload():
        raise ImportError(f"{_e}. This is the CUDA build of mbd-rs: install the CUDA 13 runtime libraries "
                          "(pip install nvidia-cuda-runtime nvidia-cublas nvidia-curand nvidia-cuda-nvrtc, or torch "
                          "with CUDA 13) or use the CPU wheel") from None
    from ._core import __version__
from .engine import (DEFAULT_MODEL, GENERATION_PARAMS, LOGITS_PARAMS, PARAMS, PROFILE_OVERRIDES, Engine, ModelInfo,
                     Stream)
from .errors import *  # noqa: F401,F403  (the exception hierarchy)
from .types import Completion, StepEvent, StreamChunk, Usage

__all__ = ["Engine", "ModelInfo", "Stream", "StreamChunk", "StepEvent", "Completion", "Usage", "GENERATION_PARAMS",
           "PROFILE_OVERRIDES", "LOGITS_PARAMS", "PARAMS",
           "DEFAULT_MODEL", "__version__"]
__all__ += errors.__all__
