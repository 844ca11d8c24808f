"""mbd-rs: fast, exact inference for block-diffusion LLMs on the Qwen2/Qwen3 architectures."""
from . import errors
from ._core import __version__
from .engine import DEFAULT_MODEL, GENERATION_PARAMS, Engine, ModelInfo, Stream
from .errors import *  # noqa: F401,F403  (the exception hierarchy)
from .types import Completion, StepEvent, StreamChunk, Usage

__all__ = ["Engine", "ModelInfo", "Stream", "StreamChunk", "StepEvent", "Completion", "Usage", "GENERATION_PARAMS",
           "DEFAULT_MODEL", "__version__"] + errors.__all__
