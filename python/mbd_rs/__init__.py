"""mbd-rs: fast, exact inference for block-diffusion LLMs on the Qwen2/Qwen3 architectures."""
from ._core import __version__
from .engine import Engine, ModelInfo
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
