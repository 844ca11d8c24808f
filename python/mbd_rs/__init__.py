"""Fast, exact inference for block-diffusion language models (SDAR, TraDo, Fast-dLLM v2, Dream/d3LLM, I-DLM)
on Qwen2, Qwen3 and Qwen3.5, in Rust on candle, driven from Python."""
from importlib import metadata as _metadata

from . import _cuda_libs, errors

_core, _cuda_libs.cuda_unavailable = _cuda_libs.import_core()  # the CUDA build of the core when it loads, else CPU
try:  # the installed distribution's version: Cargo.toml's, plus "+cu130" for the CUDA wheel
    __version__: str = _metadata.version("mbd-rs")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = _core.__version__
# The modules below import `_core`, so they come after it is chosen (CUDA or CPU) above.
from .engine import (GENERATION_PARAMS, CancelToken, KERNEL_SWITCHES, LOAD_OPTIONS, LOAD_PARAMS,  # noqa: E402
                     LOGITS_PARAMS, PARAMS, PROFILE_OVERRIDES, SCORE_PARAMS, Engine, Stream)
from .errors import *  # noqa: E402,F401,F403  (the exception hierarchy)
from .hub import DEFAULT_MODEL  # noqa: E402  (after _core, as above)
from .types import Completion, ModelInfo, StepEvent, StreamChunk, TokenLogprob, ToolCall, Usage  # noqa: E402  (as above)

__all__ = ["Engine", "ModelInfo", "Stream", "CancelToken", "StreamChunk", "StepEvent", "Completion", "Usage", "TokenLogprob",
           "ToolCall",
           "GENERATION_PARAMS", "PROFILE_OVERRIDES", "LOGITS_PARAMS", "SCORE_PARAMS", "LOAD_PARAMS", "KERNEL_SWITCHES",
           "LOAD_OPTIONS", "PARAMS",
           "DEFAULT_MODEL", "__version__"]
__all__ += errors.__all__
