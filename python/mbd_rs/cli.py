"""`mbd-rs` command line: generate, chat, info, bench, serve.

Exit codes: 0 success, 1 runtime error, 2 usage error (bad flags, bad input, unsupported model), 130 interrupted
(Ctrl-C; in `chat` it ends the answer, not the session)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .engine import Engine
    from .types import StepEvent, Usage

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
#: Ctrl-C: 128 + SIGINT, as shells report it.
EXIT_INTERRUPTED = 130


# Load flags come from the core's load options and profile overrides (mbd_rs.LOAD_PARAMS, PROFILE_OVERRIDES):
# --device for device, --attention for attention, and so on; booleans get --name / --no-name (unset: the core's
# default, or the checkpoint's). The batching caps are the server's --max-concurrency and the API's; a profile
# override that is also a generation flag (--block-size) is the generation's where the command has those.


def _add_model_flags(p: argparse.ArgumentParser, generates: bool = False) -> None:
    from .engine import BATCH_CAPS, GENERATION_PARAMS, LOAD_PARAMS, PARAMS, PROFILE_OVERRIDES
    p.add_argument("--model", "-m", default=None,
                   help="model directory or Hugging Face Hub id org/name (default: the embedded mbd-tiny model)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hub id (default: main)")
    g = p.add_argument_group("profile overrides (default: the checkpoint's)")
    names = [n for n in LOAD_PARAMS if n not in BATCH_CAPS]
    names += [n for n in PROFILE_OVERRIDES if not (generates and n in GENERATION_PARAMS)]
    for name in names:
        kind, help_ = PARAMS[name]["kind"], PARAMS[name]["help"]
        flag, group = "--" + name.replace("_", "-"), (g if name in PROFILE_OVERRIDES else p)
        if kind == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif kind == "ids":
            group.add_argument(flag, dest=name, type=int, nargs="+", default=None, help=help_)
        else:
            group.add_argument(flag, dest=name, type=_TYPES[kind], default=None, help=help_)
    p.set_defaults(load_flags=tuple(names))
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")


def load_options(a: argparse.Namespace) -> dict[str, Any]:
    """The load options and profile overrides given as flags (`_add_model_flags`), for Engine.load."""
    return {k: getattr(a, k) for k in getattr(a, "load_flags", ()) if getattr(a, k, None) is not None}


# Generation flags come from the core's parameter table (mbd_rs.PARAMS): --max-tokens for max_tokens, and so on.
# Booleans get --name / --no-name (unset: the core's default), and some an older spelling too (_NEGATED, the same as
# --no-name); a few parameters are not CLI flags.
_NOT_FLAGS = {"trace", "stop_token_ids"}  # --visual traces; token ids are an API matter
_NEGATED = {"use_cache": "--no-cache"}
_TYPES = {"int": int, "float": float, "str": str, "text": str, "source": str, "json": str}


def _add_gen_flags(p: argparse.ArgumentParser) -> None:
    from .engine import GENERATION_PARAMS, PARAMS
    g = p.add_argument_group("generation (defaults: the model family's)")
    for name in GENERATION_PARAMS:
        if name in _NOT_FLAGS:
            continue
        kind, help_ = PARAMS[name]["kind"], PARAMS[name]["help"].replace("%", "%%")  # argparse formats help
        if kind == "bool":
            flag = "--" + name.replace("_", "-")
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            if name in _NEGATED:
                g.add_argument(_NEGATED[name], dest=name, action="store_false", default=None,
                               help=f"the same as --no-{flag[2:]}")
        elif kind == "floats":
            g.add_argument("--" + name.replace("_", "-"), dest=name, type=float, nargs="+", default=None, help=help_)
        elif kind == "strings":
            g.add_argument("--" + name.replace("_", "-"), dest=name, action="append", default=None,
                           help=f"{help_} (repeatable)")
        else:
            g.add_argument("--" + name.replace("_", "-"), dest=name, type=_TYPES[kind], default=None, help=help_)
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="the output is JSON matching the JSON Schema in FILE (response_format json_schema)")
    p.add_argument("--stats", action="store_true", help="print usage (tokens per forward, tokens/s) to stderr")
    p.add_argument("--json", action="store_true", help="print the completion as JSON")


def _gen_params(a: argparse.Namespace) -> dict[str, Any]:
    from .engine import GENERATION_PARAMS
    from .errors import InvalidRequestError
    params = {k: getattr(a, k) for k in GENERATION_PARAMS if getattr(a, k, None) is not None}
    path = getattr(a, "json_schema", None)
    if path is not None:
        if "response_format" in params:
            raise InvalidRequestError("give --json-schema or --response-format, not both")
        try:
            with open(path, encoding="utf-8") as f:
                schema = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InvalidRequestError(f"--json-schema {path}: {e}") from None
        name = os.path.splitext(os.path.basename(path))[0]
        params["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    return params


def _load(a: argparse.Namespace) -> Engine:
    return load_engine(a.model, a.revision, load_options(a))


def _is_tty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def load_engine(model: str | None, revision: str | None, options: dict[str, Any]) -> Engine:
    """Engine.load for the command line: on a terminal the tqdm bar (Engine.load's default); where stderr is not a
    terminal one line per stage of the load (hub.LoadLines: resolving the path, reading weights, quantizing, ready)."""
    from .engine import Engine
    if _is_tty(sys.stderr):
        return Engine.load(model, revision=revision, **options)
    from .hub import DEFAULT_MODEL, LoadLines, _path_text, resolve_model_path
    name = DEFAULT_MODEL if model is None else _path_text(model)
    lines = LoadLines(name, sys.stderr, options.get("quantize"))
    lines.resolving()
    path = resolve_model_path(model, revision)
    lines.resolved(path)
    eng = Engine.load(path, progress=lines, **options)
    i = eng.info
    lines.ready(f"{i.weight_format} on {i.device}, {i.weight_bytes / 1e6:.1f} MB held")
    return eng


def _print_stats(u: Usage) -> None:
    print(f"[{u.completion_tokens} tokens, {u.forward_passes} forwards, {u.tokens_per_forward:.2f} tokens/forward, "
          f"{u.tokens_per_second:.1f} tokens/s, ttft {u.ttft_ms:.1f} ms"
          + (f", {u.verifications} verifications, {u.drafts_accepted}/{u.drafts_proposed} drafts accepted"
             if u.verifications else "")
          + (f", {u.forced_tokens} forced by the grammar" if u.forced_tokens else "") + "]", file=sys.stderr)


VISUAL_LEGEND = """--visual draws one line per forward pass:
  step N +K |block|block|...   K = tokens this forward decoded
  block marks: '=' completed, '*' fully active, '~' activated (not yet fully), ' ' not created yet
  inside a block: tokens decoded so far, this forward's new ones in bold green, '·' still masked; '⏎' = newline"""


class Visual:
    """Draws each forward: the generated region per block, new tokens highlighted, masks as '·'."""

    def __init__(self, eng: Engine, out: TextIO) -> None:
        self.eng, self.out = eng, out
        self.tty = out.isatty()
        self.canvas = None

    def piece(self, t: int) -> str:
        s = self.eng.detokenize([t], skip_special_tokens=False)
        return s.replace("\n", "⏎") if s else "?"

    def step(self, ev: StepEvent) -> None:
        def c(code: str, s: str) -> str:
            return f"\x1b[{code}m{s}\x1b[0m" if self.tty else s

        assert ev.canvas is not None  # trace="canvas"
        new = set(ev.decoded)
        parts = []
        live = [i for i, b in enumerate(ev.blocks) if b[2] != "inactive"]
        shown = ev.blocks[: (live[-1] + 2) if live else 1]  # created blocks and the next one
        for (s, e, state) in shown:
            cells = []
            for i in range(s, e):
                t = ev.canvas[i]
                if t < 0:
                    cells.append(c("2", "·") if state != "inactive" else " ")
                else:
                    p = self.piece(t)
                    cells.append(c("1;32", p) if i in new else p)
            mark = {"inactive": " ", "activated": "~", "fully_activated": "*", "completed": "="}[state]
            parts.append(mark + "".join(cells))
        more = " …" if len(shown) < len(ev.blocks) else ""
        self.out.write(f"step {ev.index:3d} +{len(ev.decoded)} |" + "|".join(parts) + "|" + more + "\n")
        self.out.flush()


def utf8_text(raw: "bytes | str", source: str) -> str:
    """`raw` as text, or ValueError saying that `source` is not UTF-8 and at which byte. A str is what Python read
    from argv, stdin or input(): bytes that are not UTF-8 come as surrogate escapes (which the core would refuse as
    "lone surrogates")."""
    if isinstance(raw, str):
        try:
            data = raw.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that is not an escaped byte: the core's check names it
            return raw
    else:
        data = raw
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source} is not UTF-8 text: byte {e.start} (0x{data[e.start]:02x}) is not valid UTF-8 "
                         f"({e.reason}); convert it first, e.g. with iconv -t UTF-8") from None


def _newlines(text: str) -> str:
    """Line ends as a text-mode open() gives them (universal newlines: "\r\n" and "\r" become "\n")."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _show(stream: Any, vis: Visual | None, quiet: bool, note: PrefillNote) -> None:
    """`generate`'s output as it streams: each forward drawn (--visual), or the text (unless --json)."""
    for ch in stream:
        note.clear()
        if vis and ch.step:
            vis.step(ch.step)
        elif not quiet and not vis:
            sys.stdout.write(ch.text)
            sys.stdout.flush()


def cmd_generate(a: argparse.Namespace) -> int:
    eng = _load(a)
    if a.file:
        with open(a.file, "rb") as f:
            prompt = _newlines(utf8_text(f.read(), f"the prompt file {a.file}"))
    elif a.prompt is not None and a.prompt != "-":
        prompt = utf8_text(a.prompt, "the prompt")
    else:
        stdin = getattr(sys.stdin, "buffer", None)
        prompt = utf8_text(stdin.read() if stdin is not None else sys.stdin.read(), "the prompt on stdin")
        if prompt.endswith("\n"):  # `echo "..." | mbd-rs generate`: the shell's newline is not part of the prompt
            prompt = prompt[:-2] if prompt.endswith("\r\n") else prompt[:-1]
    params = _gen_params(a)
    if a.visual:
        params["trace"] = "canvas"
    if a.chat:
        stream = eng.stream_chat([{"role": "user", "content": prompt}], **params)
    else:  # chat by default where the model has a template (Engine.stream), raw with --raw
        stream = eng.stream(prompt, raw=a.raw, **params)
    vis = Visual(eng, sys.stdout) if a.visual else None
    if vis:
        print(VISUAL_LEGEND, file=sys.stderr)

    # on a terminal: the prefill's progress while no text has come
    note = PrefillNote(sys.stderr).follow(lambda: stream.prompt_progress)
    try:
        _show(stream, vis, a.json, note)
    finally:
        note.clear()
    comp = stream.result()
    if a.json:
        out: dict[str, Any] = {"text": comp.text, "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                               "usage": comp.usage.__dict__}
        if params.get("logprobs") is not None:  # --logprobs K: each token's, as [id, logprob, [[id, logprob], ...]]
            out["logprobs"] = [[t.token_id, t.logprob, [list(x) for x in t.top_logprobs]] for t in comp.logprobs]
        print(json.dumps(out))
    elif vis:
        print(f"\n{comp.text}")
    else:
        print()
    if a.stats or vis:
        _print_stats(comp.usage)
    return EXIT_OK


CHAT_HELP = ("commands: /system TEXT sets the system prompt (and starts a new conversation), /reset forgets the "
             "conversation, /save FILE writes it as JSON messages, /help shows this; a line ending in \\ continues "
             "on the next; //text sends /text. Ctrl-C stops an answer or clears the line, Ctrl-D quits")

#: The seconds without text after which a terminal shows the prefill's progress, and how often it is redrawn.
PREFILL_NOTE_SECONDS = 2.0
PREFILL_NOTE_EVERY = 0.5


class PrefillNote:
    """On a terminal (`out`), the prefill's progress when no text has come `after` seconds after the start (a long
    prompt): "prefilling 37% of 1536 tokens…", redrawn every `every` seconds from the stream's `prompt_progress`
    (given by `follow`), "prefilled 1536 tokens, decoding…" once the prompt is done; erased with a carriage return
    at the first chunk (`clear`) or at the end. Elsewhere it does nothing."""

    def __init__(self, out: TextIO, after: float = PREFILL_NOTE_SECONDS, every: float = PREFILL_NOTE_EVERY) -> None:
        self.out, self.after, self.every = out, after, every
        self.progress: Callable[[], tuple[int, int]] | None = None
        self.lock = threading.Lock()
        self.shown = False
        self.done = threading.Event()
        if _is_tty(out):
            threading.Thread(target=self._run, daemon=True, name="mbd-prefill-note").start()
        else:
            self.done.set()

    def follow(self, progress: Callable[[], tuple[int, int]]) -> "PrefillNote":
        """Show the progress `progress` reads ((positions computed, prompt length), e.g. `Stream.prompt_progress`)."""
        self.progress = progress
        return self

    def line(self) -> str | None:
        """The note as it reads now (None: nothing to say yet)."""
        if self.progress is None:
            return None
        try:
            done, total = self.progress()
        except Exception:  # the note is a courtesy: a failure to read it leaves it out
            return None
        if total <= 0:
            return None
        if done >= total:
            return f"prefilled {total} tokens, decoding…"
        return f"prefilling {100 * done // total}% of {total} tokens…"

    def _run(self) -> None:
        if self.done.wait(self.after):
            return
        last = None
        while True:
            text = self.line()
            with self.lock:
                if self.done.is_set():
                    return
                if text is not None and text != last:
                    self.out.write(("\r\x1b[K" if self.shown else "") + text)
                    self.out.flush()
                    self.shown, last = True, text
            if self.done.wait(self.every):
                return

    def clear(self) -> None:
        """The first text came (or the answer ended): erase the note if it is shown, and show none later."""
        with self.lock:
            if self.done.is_set():
                return
            self.done.set()
            if self.shown:
                self.out.write("\r\x1b[K")
                self.out.flush()


def _history_file() -> str:
    """The chat's readline history: $XDG_STATE_HOME/mbd-rs/chat_history (default ~/.local/state/...)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "mbd-rs", "chat_history")


def _start_readline() -> Callable[[], None]:
    """Line editing and history for the chat prompt when stdin is a terminal (readline: arrows, up-arrow recalls,
    Ctrl-R), the history kept in _history_file() across sessions. Returns what saves the history at the end."""
    if not _is_tty(sys.stdin):
        return lambda: None
    try:
        import readline
    except ImportError:  # Windows without pyreadline: input() as it is
        return lambda: None
    path = _history_file()
    try:
        readline.read_history_file(path)
    except (OSError, ValueError):  # none yet, or unreadable: start empty
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def _read_message() -> str:
    """One message from the chat prompt: a line, or lines joined while each ends in a backslash (the backslash
    dropped, prompt ". " for the next). EOFError at Ctrl-D (or the end of stdin), KeyboardInterrupt at Ctrl-C."""
    lines, prompt = [], "> "
    while True:
        line = input(prompt)
        if not line.endswith("\\"):
            lines.append(line)
            return "\n".join(lines)
        lines.append(line[:-1])
        prompt = ". "


def _save_messages(messages: list[dict[str, str]], path: str) -> str:
    """Write `messages` as a JSON array to `path`; what to say of it."""
    try:
        with open(os.path.expanduser(path), "w", encoding="utf-8") as f:
            json.dump(messages, f, ensure_ascii=False, indent=1)
            f.write("\n")
    except OSError as e:
        return f"mbd-rs: cannot save to {path}: {e.strerror or e}"
    return f"(saved {len(messages)} messages to {path})"


def cmd_chat(a: argparse.Namespace) -> int:
    eng = _load(a)
    params = _gen_params(a)
    # The embedded model was trained on single questions only: each line is its own conversation.
    single_turn = a.single_turn or os.path.samefile(eng.info.path, _default_model())
    mode = "single-turn: each line is a new conversation" if single_turn else "keeps history"
    print(f"mbd-rs chat ({mode}) — {CHAT_HELP}", file=sys.stderr)
    system: str | None = a.system
    # The conversation since the start, /reset or /system: what /save writes. The model sees the system prompt and
    # all of it, or (single-turn) the system prompt and the new question only.
    conversation: list[dict[str, str]] = []

    def with_system(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
        return ([{"role": "system", "content": system}] if system else []) + msgs

    save_history = _start_readline()
    try:
        while True:
            try:
                line = _read_message()
            except EOFError:  # Ctrl-D, or the end of piped input
                if _is_tty(sys.stdin):
                    print()
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, a fresh prompt
                print()
                continue
            if not line.strip():
                continue
            try:
                line = utf8_text(line, "that line")
            except ValueError as e:
                print(f"mbd-rs: {e}", file=sys.stderr)
                continue
            if line.startswith("/") and not line.startswith("//"):
                cmd, _, arg = line.strip().partition(" ")
                arg = arg.strip()
                if cmd == "/reset":
                    conversation.clear()
                    print("(history cleared)", file=sys.stderr)
                elif cmd == "/help":
                    print(CHAT_HELP, file=sys.stderr)
                elif cmd == "/system":
                    system = arg or None
                    conversation.clear()
                    print(f"(system prompt set: {arg}; new conversation)" if arg
                          else "(system prompt cleared; new conversation)", file=sys.stderr)
                elif cmd == "/save":
                    if not arg:
                        print("mbd-rs: /save needs a file name: /save FILE", file=sys.stderr)
                    else:
                        print(_save_messages(with_system(conversation), arg), file=sys.stderr)
                else:
                    print(f"mbd-rs: unknown command {cmd}; /help lists them (//text sends a line that starts "
                          f"with /)", file=sys.stderr)
                continue
            if line.startswith("//"):
                line = line[1:]
            conversation.append({"role": "user", "content": line})
            messages = with_system(conversation[-1:] if single_turn else conversation)
            _answer(eng, messages, params, a.stats, conversation)
    finally:
        save_history()
    return EXIT_OK


def _answer(eng: Engine, messages: list[dict[str, str]], params: dict[str, Any], stats: bool,
            conversation: list[dict[str, str]]) -> None:
    """Stream the answer to `messages` to stdout and add it to `conversation` (the question is its last message).
    Ctrl-C stops it: the generation is cancelled, the question dropped from the conversation, and the stats line
    (with --stats) still comes; a request the engine refuses (e.g. past the context) is said, and dropped too."""
    from .errors import ContextLengthError, InvalidRequestError
    stream = None
    note = PrefillNote(sys.stderr)
    try:
        stream = started = eng.stream_chat(messages, **params)
        note.follow(lambda: started.prompt_progress)
        for ch in stream:
            note.clear()
            sys.stdout.write(ch.text)
            sys.stdout.flush()
        comp = stream.result()
    except KeyboardInterrupt:  # Ctrl-C ends this answer (the stream is cancelled), not the session
        note.clear()
        usage = None
        if stream is not None:
            stream.cancel()
            try:
                for _ in stream:  # the cancelled stream's last chunk, with its usage
                    pass
            except Exception:
                pass
            stream.close()
            usage = stream.usage
        conversation.pop()
        print("\n(interrupted)", file=sys.stderr)
        if stats and usage is not None:
            _print_stats(usage)
        return
    except (InvalidRequestError, ContextLengthError) as e:
        note.clear()
        conversation.pop()
        print(f"mbd-rs: error: {e}", file=sys.stderr)
        return
    finally:
        note.clear()
    print()
    if stats:
        _print_stats(comp.usage)
    conversation.append({"role": "assistant", "content": comp.text})


def _default_model() -> str:
    from .hub import DEFAULT_MODEL
    return DEFAULT_MODEL


def cmd_info(a: argparse.Namespace) -> int:
    from . import MbdError, ModelFileNotFoundError, UnsupportedArchitectureError
    try:
        eng = _load(a)
    except UnsupportedArchitectureError as e:
        print(f"mbd-rs: not supported: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelFileNotFoundError, FileNotFoundError) as e:
        print(f"mbd-rs: cannot load: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MbdError as e:
        print(f"mbd-rs: cannot load: {e}", file=sys.stderr)
        return EXIT_USAGE
    if a.json:
        print(json.dumps(eng.info.__dict__, indent=1))
        return EXIT_OK
    i = eng.info
    moe = f", {i.num_experts} experts ({i.num_experts_per_tok} per token)" if i.num_experts else ""
    rows = [
        ("model", i.path),
        ("family", f"{i.family} ({i.architecture}, {i.arch} weights{moe})"),
        ("size", f"{i.num_parameters / 1e6:.2f}M parameters, {i.weight_bytes / 2**20:.1f} MiB in memory as "
                 f"{i.weight_format} ({i.dtype} compute{', int8 activations' if i.int8_activations else ''}, "
                 f"stored {i.stored_dtype or 'unknown'}) on {i.device}"),
        ("shape", f"{i.num_layers} layers, hidden {i.hidden_size}, {i.num_attention_heads} heads / "
                  f"{i.num_key_value_heads} KV x {i.head_dim}, MLP {i.intermediate_size}, vocab {i.vocab_size}"),
        ("context", f"{i.max_context} tokens"),
        ("decoding", f"{i.attention} attention, block {i.block_size}, {i.alignment} grid, "
                     f"{'shifted' if i.logits_shift else 'unshifted'} logits, mask id {i.mask_token_id}, "
                     f"EOS {i.eos_token_ids}"),
        ("defaults", f"{i.default_acceptance} acceptance, tau {i.default_threshold:g}, alpha "
                     f"{i.default_block_add_threshold:g}, beta {i.default_decoded_token_threshold:g}, forced progress "
                     f"{i.default_forced_progress}"
                     + (f", sub-blocks of {i.default_sub_block_size}" if i.default_sub_block_size else "")),
        ("supported", "yes"),
    ]
    print("\n".join(f"{k:10s} {v}" for k, v in rows))
    return EXIT_OK


def _peak_rss_bytes() -> int | None:
    """Peak resident set size of this process so far, or None where the OS does not say."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# Chat prompts of the embedded model's task families (held-out-style instances): what it was trained to answer.
BENCH_CHAT = ["sort 7 2 9 4 1 8", "reverse q w e r t y", "repeat abc 4", "count a in banana", "hello Ada"]


def cmd_bench(a: argparse.Namespace) -> int:
    eng = _load(a)
    peak_after_load = _peak_rss_bytes()
    params = _gen_params(a)
    params.setdefault("max_tokens", 64)
    if a.prompt_len is None and os.path.samefile(eng.info.path, _default_model()):
        # the embedded model answers chat prompts of its tasks; a random prompt would stop at once
        runs = [functools.partial(eng.chat, [{"role": "user", "content": q}], **params) for q in BENCH_CHAT]
        prompt_desc = f"{len(BENCH_CHAT)} chat prompts"
    else:
        import random
        r = random.Random(0)
        special = set(eng.info.eos_token_ids) | {eng.info.mask_token_id}
        n = a.prompt_len or 32
        prompt = [t for t in (r.randrange(eng.info.vocab_size) for _ in range(n * 2)) if t not in special][:n]
        runs = [functools.partial(eng.generate, prompt, **params)]
        prompt_desc = f"{n} random tokens"
    rows: list[tuple[Usage, float]] = []
    for i in range(a.repeats + 1):
        for run in runs:
            t = time.perf_counter()
            c = run()
            dt = time.perf_counter() - t
            if i > 0:  # the first round warms up
                rows.append((c.usage, dt))
    if statistics.mean(u.completion_tokens for u, _ in rows) < 8:
        print("mbd-rs: warning: the runs decoded fewer than 8 tokens on average (an early EOS?); these numbers say "
              "little — try --no-early-stop, another prompt or a larger --max-tokens", file=sys.stderr)
    tokens = sum(u.completion_tokens for u, _ in rows)
    forwards = sum(u.forward_passes for u, _ in rows)
    res = {"model": eng.info.path, "prompts": prompt_desc, "completion_tokens": tokens, "forward_passes": forwards,
           "tokens_per_forward": tokens / max(forwards, 1),
           "tokens_per_second": tokens / sum(dt for _, dt in rows),
           "ms_per_forward": 1e3 * sum(dt for _, dt in rows) / max(forwards, 1), "repeats": a.repeats}
    # Memory: the weights as held in memory against the process's peak RSS.
    weights = eng.info.weight_bytes
    res["weights_mb"] = round(weights / 2**20, 1)
    if peak_after_load is not None:
        res["peak_rss_after_load_mb"] = round(peak_after_load / 2**20, 1)
        res["peak_rss_after_load_over_weights"] = round(peak_after_load / weights, 3)
        res["peak_rss_end_mb"] = round((_peak_rss_bytes() or 0) / 2**20, 1)  # not None, as after load
    print(json.dumps(res, indent=1) if a.json else "\n".join(f"{k:26s} {v}" for k, v in res.items()))
    return EXIT_OK


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from .server import serve
    except ImportError as e:
        print(f"mbd-rs: the server needs starlette, uvicorn and prometheus_client: pip install 'mbd-rs[server]' "
              f"(from a checkout: pip install '.[server]') ({e})", file=sys.stderr)
        return EXIT_USAGE
    if a.ray and a.load_prefix_cache:
        print("mbd-rs: --load-prefix-cache serves one engine, not Ray Serve's replicas", file=sys.stderr)
        return EXIT_USAGE
    if a.ray:
        try:
            from .ray_serve import serve_ray
            return serve_ray(a, load_options(a))  # each replica resolves the model itself (on its node)
        except ImportError as e:
            print(f"mbd-rs: {e}", file=sys.stderr)
            return EXIT_USAGE
    ray_only = [f for f, v in [("--replicas", a.replicas != 1), ("--autoscale", a.autoscale),
                                ("--replica-cpus", a.replica_cpus != 1.0), ("--replica-gpus", a.replica_gpus != 0.0),
                                ("--ray-address", a.ray_address), ("--ray-config", a.ray_config)] if v]

    if ray_only:
        print(f"mbd-rs: {', '.join(ray_only)} need --ray", file=sys.stderr)
        return EXIT_USAGE
    from .hub import is_hub_id
    if a.model is not None and is_hub_id(a.model):  # serve it under its id, not its snapshot's commit hash
        a.model_name = a.model_name or a.model
    eng = load_engine(a.model, a.revision, load_options(a))
    a.model = eng.info.path
    if a.load_prefix_cache:
        n = eng.load_prefix_cache(a.load_prefix_cache)
        print(f"mbd-rs: {n} prefix cache pages from {a.load_prefix_cache}", file=sys.stderr)
    return serve(a, load_options(a), engine=eng)


def _int_in(lo: int, hi: int) -> Any:
    """An argparse type: an integer in [lo, hi] (argparse turns the ValueError into a usage error, exit 2)."""
    def parse(text: str) -> int:
        v = int(text)
        if not lo <= v <= hi:
            raise ValueError(f"{v} is not between {lo} and {hi}")
        return v
    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def _min_max(text: str) -> "tuple[int, int]":
    """An argparse type: MIN:MAX replicas, 0 <= MIN <= MAX, MAX >= 1."""
    lo, sep, hi = text.partition(":")
    a, b = int(lo), int(hi) if sep else -1
    if not (sep and 0 <= a <= b and b >= 1):
        raise ValueError(f"{text!r} is not MIN:MAX with 0 <= MIN <= MAX and MAX >= 1")
    return a, b


_min_max.__name__ = "MIN:MAX"


def _positive_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise ValueError(f"{text} is not >= 0")
    return v


_positive_float.__name__ = "number >= 0"


def _seconds(text: str) -> float:
    v = float(text)
    if not 0 < v < float("inf"):
        raise ValueError(f"{text} is not a number of seconds > 0")
    return v


_seconds.__name__ = "number of seconds > 0"


def _host_list(text: str) -> "list[str]":
    names = [h.strip() for h in text.split(",") if h.strip()]
    if not names:
        raise ValueError(f"{text!r} names no host")
    return names


_host_list.__name__ = "comma-separated host names"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .server.limits import (BODY_TIMEOUT, CONNECTIONS, HEADER_TIMEOUT, KEEPALIVE, MAX_BODY_BYTES,
                                MAX_PROMPT_TOKENS, REQUEST_TIMEOUT)
    ap = argparse.ArgumentParser(prog="mbd-rs", description=(
        "Fast, exact inference for block-diffusion language models (SDAR, TraDo, Fast-dLLM v2, Dream/d3LLM, I-DLM) "
        "on Qwen2, Qwen3 and Qwen3.5, in Rust on candle, driven from Python."))
    ap.add_argument("--version", action="version", version=f"mbd-rs {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt, streaming to stdout", epilog=VISUAL_LEGEND,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", nargs="?", help="the prompt ('-' or absent: read stdin)")
    g.add_argument("--file", "-f", help="read the prompt from a file")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true",
                      help="complete the prompt as it is (default: as a user message with the model's chat template, "
                           "when it has one and the prompt is not templated already)")
    mode.add_argument("--chat", action="store_true",
                      help="always send the prompt as a user message with the chat template (the default where the "
                           "model has one)")
    g.add_argument("--visual", action="store_true",
                   help="draw every forward: blocks and the tokens each one decodes (legend below)")
    _add_model_flags(g, generates=True)
    _add_gen_flags(g)
    c = sub.add_parser("chat", help="interactive chat (/system, /reset, /save, /help)")
    c.add_argument("--system", default=None, metavar="TEXT", help="the system prompt (/system TEXT changes it)")
    c.add_argument("--single-turn", action="store_true",
                   help="every line is a new conversation (always so for the embedded model, trained on single questions)")
    _add_model_flags(c, generates=True)
    _add_gen_flags(c)
    i = sub.add_parser("info", help="describe a model directory and whether it is supported (exit 2 if not)")
    i.add_argument("model_path", nargs="?", default=None,
                   help="model directory or Hub id org/name (default: the embedded model)")
    i.add_argument("--json", action="store_true", help="print every field as JSON")
    _add_model_flags(i)
    b = sub.add_parser("bench", help="time generation on a model")
    b.add_argument("--prompt-len", type=_int_in(1, 1 << 20), default=None,
                   help="time a random prompt of this many tokens (default: the embedded model's chat prompts, "
                        "or 32 random tokens for other models)")
    b.add_argument("--repeats", type=_int_in(1, 10_000), default=3, help="timed runs after a warm-up (default: 3)")
    _add_model_flags(b, generates=True)
    _add_gen_flags(b)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server, with a live view of decoding at its root URL",
                       description="OpenAI-compatible HTTP server (/v1/...), with a live view of decoding at its root URL "
                                   "(http://HOST:PORT/ in a browser)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=_int_in(1, 65535), default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)")
    s.add_argument("--max-concurrency", type=_int_in(1, 4096), default=4,
                   help="generations batched together, one forward for all (default: 4)")
    s.add_argument("--max-queue", type=_int_in(0, 1 << 16), default=None,
                   help="generations waiting for a place in the batch; more get 503 (default: --max-concurrency)")
    s.add_argument("--max-body-bytes", type=_int_in(1024, 1 << 30), default=MAX_BODY_BYTES,
                   help="largest request body accepted; larger get 413 (default: 4 MiB)")
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the directory's name)")
    s.add_argument("--max-prompt-tokens", type=_int_in(1, 1 << 30), default=MAX_PROMPT_TOKENS,
                   help="the most token positions one request spans, its prompt plus max_tokens; longer requests "
                        f"get 400 context_length_exceeded before any work (default: {MAX_PROMPT_TOKENS}, 16 prefill "
                        "chunks: seconds of work on a CPU, not a checkpoint's whole context)")
    s.add_argument("--request-timeout", type=_seconds, default=REQUEST_TIMEOUT,
                   help="seconds a request may run; then its generations are cancelled (streams end with "
                        "finish_reason 'cancelled', other requests get 504) (default: %(default)g)")
    s.add_argument("--header-timeout", type=_seconds, default=HEADER_TIMEOUT,
                   help="seconds a connection has to send its request headers, then it is closed (default: "
                        "%(default)g)")
    s.add_argument("--body-timeout", type=_seconds, default=BODY_TIMEOUT,
                   help="seconds a request has to send its whole body once its headers are in, then it gets 408 "
                        "and the connection is closed (default: %(default)g)")
    s.add_argument("--sse-keepalive", type=_seconds, default=KEEPALIVE,
                   help="seconds a streaming response may go without an event (a long prefill, a wait in the "
                        "queue) before it sends a ': keep-alive' comment line (default: %(default)g)")
    s.add_argument("--limit-concurrency", type=_int_in(1, 1 << 20), default=None,
                   help="open connections at most; a new one over it replaces the one that has waited longest "
                        "for its headers, else for its body, and is closed at once when every connection is serving "
                        f"a request (default: {CONNECTIONS}, or what the open-files limit leaves; the soft limit is "
                        "raised to the hard one at start-up)")
    s.add_argument("--load-prefix-cache", default=None, metavar="FILE",
                   help="start the prefix cache from a file Engine.save_prefix_cache wrote (a long system prompt "
                        "computed once); refused when this engine would compute other K/V")
    s.add_argument("--allowed-hosts", default=None, type=_host_list, metavar="NAMES",
                   help="comma-separated Host names served besides the bound address and localhost ('*': any; "
                        "'.example.com': a domain and its subdomains); other Hosts get 421 (DNS rebinding). "
                        "Bound to 0.0.0.0 or ::, any IP address and this machine's names are served too")
    r = s.add_argument_group("scale-out on Ray Serve (pip install 'mbd-rs[ray]')")
    r.add_argument("--ray", action="store_true", help="serve replicas of the engine behind Ray Serve's HTTP proxy")
    r.add_argument("--replicas", type=_int_in(1, 4096), default=1, help="number of replicas (default: 1)")
    r.add_argument("--autoscale", type=_min_max, default=None, metavar="MIN:MAX",
                   help="let Ray Serve scale between MIN and MAX replicas by load (instead of --replicas)")
    r.add_argument("--replica-cpus", type=_positive_float, default=1.0, help="Ray CPUs per replica (default: 1)")
    r.add_argument("--replica-gpus", type=_positive_float, default=0.0, help="Ray GPUs per replica (default: 0)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start` runs here; default: start a local one, "
                        "or RAY_ADDRESS)")
    r.add_argument("--ray-config", default=None, metavar="FILE",
                   help="YAML/JSON with deployment settings (num_replicas, autoscaling, num_cpus, num_gpus, "
                        "max_concurrency, ...), over the flags")
    _add_model_flags(s)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "info" and a.model_path:
        a.model = a.model_path
    from . import ContextLengthError, InvalidRequestError, MbdError
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "bench": cmd_bench, "serve": cmd_serve}[a.cmd](a)
    except (InvalidRequestError, ContextLengthError, TypeError, FileNotFoundError, ValueError) as e:
        if a.verbose:
            raise
        print(f"mbd-rs: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MbdError as e:
        if a.verbose:
            raise
        print(f"mbd-rs: error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("\nmbd-rs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
