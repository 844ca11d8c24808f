"""Where a model comes from and how its load is shown: `resolve_model_path` (the embedded model, a local path, or a
Hugging Face Hub id through the local Hub cache), `_LoadBar` (Engine.load's progress) and `LoadLines` (the command
line's record of a load's stages, where stderr is not a terminal)."""
from __future__ import annotations

import errno
import os
import re
import sys
import time
from typing import Any, Callable, Optional, TextIO, Union

from .errors import InvalidRequestError, ModelFileNotFoundError

#: The model shipped inside the package (mbd-tiny v3, trained here by training/train.py --family tiny): used when no
#: path is given.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "mbd-tiny")

#: Engine.load's progress: None (a bar for large checkpoints on a terminal), True, False, or a callable.
LoadProgress = Union[bool, Callable[[int, int], None], None]
#: With progress=None, checkpoints smaller than this load without a bar.
LOAD_BAR_MIN_BYTES = 256 << 20

# The files a model directory is read from (the rest of a Hub repo, e.g. *.bin or *.gguf, is never downloaded).
HUB_ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+")


PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def _path_text(path: PathArg) -> str:
    """A model path as text: str, bytes or os.PathLike (bytes decoded as the file system does, os.fsdecode); any other
    type is an InvalidRequestError naming it."""
    try:
        return os.fsdecode(path)
    except TypeError:
        raise InvalidRequestError(f"the model path must be a str, bytes or os.PathLike, got {type(path).__name__}: "
                                  f"{path!r:.80}") from None


def is_hub_id(path: PathArg) -> bool:
    """True when `path` names no existing file or directory and has the shape of a Hub repo id ("org/name": one
    slash, not starting with "." or "/")."""
    text = _path_text(path)
    return bool(_HUB_ID.fullmatch(text)) and not os.path.exists(text)


def resolve_model_path(path: Optional[PathArg], revision: Optional[str] = None) -> str:
    """The local model directory for `path` (str, bytes or os.PathLike): the embedded model for None, `path` itself
    for a local path, and for a Hub id ("org/name") its snapshot in the Hugging Face cache, fetched with
    huggingface_hub.snapshot_download (which honours HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN, and shows
    its own progress bars)."""
    if path is None:
        path = DEFAULT_MODEL
    text = _path_text(path)
    if not is_hub_id(text):
        if revision is not None:
            raise InvalidRequestError(f"revision={revision!r} applies only to Hugging Face Hub ids (org/name); "
                                      f"{text!r} is a local path")
        return text
    what = repr(text) if revision is None else f"{text!r} (revision {revision!r})"
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ModelFileNotFoundError(
            errno.ENOENT, f"{what} is not a local directory, and loading a Hugging Face Hub id needs huggingface_hub: "
            f"pip install huggingface_hub (or pip install 'mbd-rs[hub]')", text) from None
    try:
        return str(snapshot_download(text, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # offline and not cached, no network, unknown repo or revision, no access: all "not found"
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelFileNotFoundError(
            errno.ENOENT, f"{what} is neither a local directory nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the Hub could not provide it ({type(e).__name__}: {reason})",
            text) from e


class _LoadBar:
    """Engine.load's progress (see its docstring): a tqdm bar over the checkpoint's bytes, created at the first
    report (when the total is known), or the caller's callable."""

    def __init__(self, progress: LoadProgress):
        self.bar: Any = None
        self.decided = False
        self.user = progress if callable(progress) else None
        self.tqdm: Any = None
        if progress is False or self.user is not None:
            return
        if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError:  # tqdm is optional (huggingface_hub brings it)
            return
        self.tqdm, self.forced = tqdm, progress is True

    @property
    def callback(self) -> Optional[Callable[[int, int], None]]:
        return self.user if self.user is not None else (self.update if self.tqdm is not None else None)

    def update(self, done: int, total: int) -> None:
        if not self.decided:
            self.decided = True
            if self.forced or total >= LOAD_BAR_MIN_BYTES:
                self.bar = self.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
                                     leave=False, file=sys.stderr)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: LoadLines writes a "reading weights" line at most this often between its quarter marks (seconds).
LOAD_LINE_SECONDS = 5.0


def _mb(done: int, total: int) -> str:
    """`done`/`total` bytes as megabytes (10**6 bytes), with a decimal under 100 MB."""
    if total >= 100_000_000:
        return f"{done // 1_000_000}/{total // 1_000_000} MB"
    return f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"


class LoadLines:
    """A load's stages as lines on `out`, each "mbd-rs: loading NAME: STAGE": the command line's record of a load
    where stderr is not a terminal (a log file, a pipe, a service's journal; a terminal gets the tqdm bar instead).
    The stages: `resolving()` the path (a Hub id may download), `resolved(path)` when that named another directory,
    the weights read (as Engine.load's progress callable: the first report and the last, and between them a quarter
    mark passed a second or more after the line before, or LOAD_LINE_SECONDS since it), quantizing (with a quantize format: once, at the first report, since
    each matrix is quantized as it is read), and `ready(detail)` with the seconds since this object was made."""

    def __init__(self, name: str, out: TextIO, quantize: Optional[str] = None):
        self.name, self.out, self.quantize = name, out, quantize
        self.t0 = time.monotonic()
        self.last: Optional[float] = None
        self.quarter = -1

    def say(self, stage: str) -> None:
        try:
            print(f"mbd-rs: loading {self.name}: {stage}", file=self.out, flush=True)
        except (OSError, ValueError):  # a closed or broken stderr does not stop the load
            pass

    def resolving(self) -> None:
        self.say("resolving the path")

    def resolved(self, path: str) -> None:
        if path != self.name:
            self.say(f"resolved to {path}")

    def __call__(self, done: int, total: int) -> None:
        now, quarter = time.monotonic(), (4 * done // total if total > 0 else 4)
        first, since = self.last is None, now - (self.last or now)
        if first or done >= total or (quarter > self.quarter and since >= 1.0) or since >= LOAD_LINE_SECONDS:
            self.say(f"reading weights {_mb(done, total)}")
            self.last, self.quarter = now, quarter
        if first and self.quantize:
            self.say(f"quantizing to {self.quantize} (each matrix as it is read)")

    def ready(self, detail: str = "") -> None:
        self.say(f"ready in {time.monotonic() - self.t0:.2f} s" + (f" ({detail})" if detail else ""))
