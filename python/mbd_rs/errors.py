"""The exception hierarchy. Every error mbd-rs raises on bad input is one of these (or TypeError for an
unknown keyword), with a message that names the file, field or parameter and what was expected."""


class MbdError(Exception):
    """Base class of all mbd-rs errors."""


class ModelLoadError(MbdError):
    """A model directory could not be loaded (unreadable/truncated weights, missing or misshapen tensor)."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A file the model directory must contain is missing; `.filename` names it."""


class ConfigError(MbdError, ValueError):
    """config.json (or another JSON file of the model) is malformed, or a field is missing or of the wrong type."""


class UnsupportedArchitectureError(MbdError, ValueError):
    """The checkpoint's architecture, or one of its options (e.g. rope_scaling), is not supported."""


class InvalidRequestError(MbdError, ValueError):
    """A request parameter or input is invalid (out-of-range value, bad token id, empty prompt...)."""

    #: the request field at fault, where one is (the server's error.param)
    param: "str | None" = None


class ContextLengthError(InvalidRequestError):
    """The prompt plus the requested completion does not fit the model's context."""


class RequestCancelledError(MbdError):
    """A long call (`Engine.logits`, `Engine.prompt_logprobs`) was stopped by its `CancelToken`."""


class InternalError(MbdError, RuntimeError):
    """A bug inside mbd-rs (a caught Rust panic). Please report it."""


__all__ = [
    "MbdError",
    "ModelLoadError",
    "ModelFileNotFoundError",
    "ConfigError",
    "UnsupportedArchitectureError",
    "InvalidRequestError",
    "ContextLengthError",
    "RequestCancelledError",
    "InternalError",
]
