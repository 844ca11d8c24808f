"""mbd-rs: fast, exact inference for block-diffusion LLMs on the Qwen2/Qwen3 architectures."""
from ._core import __version__
from .engine import GENERATION_PARAMS, Engine, ModelInfo, Stream
from .types import Completion, StepEvent, StreamChunk, Usage
from .errors import (
    ConfigError,
    ContextLengthError,
    InternalError,
    InvalidRequestError,
    MbdError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
)

__all__ = [
    "Engine",
    "ModelInfo",
    "Stream",
    "StreamChunk",
    "StepEvent",
    "Completion",
    "Usage",
    "GENERATION_PARAMS",
    "MbdError",
    "ModelLoadError",
    "ModelFileNotFoundError",
    "ConfigError",
    "UnsupportedArchitectureError",
    "InvalidRequestError",
    "ContextLengthError",
    "InternalError",
    "__version__",
]
