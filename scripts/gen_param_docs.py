#!/usr/bin/env python3
"""Write what is derived from the core's parameter registry (`mbd_rs.PARAMS` and its groups), so neither can drift
from the code: docs/parameters.md (the table of every parameter a caller can pass) and python/mbd_rs/params.py (the
same names as TypedDicts, so `Engine.generate(..., **params)` and friends are typed: IDEs complete them, mypy checks
them, `help(mbd_rs.params.GenerationParams)` lists them). tests/test_docs.py checks that both files are what this
script writes.

    python scripts/gen_param_docs.py            # rewrite both
    python scripts/gen_param_docs.py --check    # exit 1 if either is stale
"""
from __future__ import annotations

import os
import sys

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "parameters.md")
PY_OUT = os.path.join(ROOT, "python", "mbd_rs", "params.py")

# a parameter's kind (ParamKind) as the Python type its value arrives as
PY_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str", "text": "str", "source": "str",
            "json": "Union[str, Mapping[str, Any], type]", "strings": "Union[str, Sequence[str]]",
            "ids": "Sequence[int]", "bool_or_str": "Union[bool, str]", "floats": "Sequence[float]"}
# TypedDict name -> (registry groups, what takes it)
TYPED = [
    ("GenerationParams", ["GENERATION_PARAMS"], "Engine.generate / stream / chat / stream_chat"),
    ("LoadParams", ["LOAD_PARAMS", "PROFILE_OVERRIDES", "KERNEL_SWITCHES"], "Engine.load"),
    ("LogitsParams", ["LOGITS_PARAMS"], "Engine.logits"),
    ("ScoreParams", ["SCORE_PARAMS"], "Engine.prompt_logprobs"),
]

GROUPS = [
    ("Generation", "GENERATION_PARAMS",
     "`Engine.generate` / `stream` / `chat` / `stream_chat` keyword arguments; the server's body fields (OpenAI's "
     "names where it has them, the rest as extensions); `mbd-rs generate` / `chat` / `bench` flags (`max_tokens`: "
     "`--max-tokens`; a bool `x`: `--x` / `--no-x`, and `use_cache` also `--no-cache`)."),
    ("Load options", "LOAD_PARAMS",
     "`Engine.load` keyword arguments; `mbd-rs` flags on every command (the batching caps: `set_batching`, and the "
     "server's `--max-concurrency`); Ray Serve deployment keys."),
    ("Profile overrides", "PROFILE_OVERRIDES",
     "`Engine.load` keyword arguments that replace what the checkpoint says about decoding it; `mbd-rs` flags."),
    ("Kernel switches", "KERNEL_SWITCHES",
     "`Engine.load` keyword arguments (or `_kernels=dict(...)`) for benchmarks' A/B runs; not a stable API."),
    ("Logits", "LOGITS_PARAMS", "`Engine.logits` keyword arguments."),
    ("Prompt scores", "SCORE_PARAMS", "`Engine.prompt_logprobs` keyword arguments."),
]


def render() -> str:
    lines = ["# Parameters", "",
             "Every name a caller can pass, with its kind and what it does: generated from the core's registry "
             "(`mbd_rs.PARAMS`, written once in `crates/mbd-core/src/params/request.rs`) by "
             "`scripts/gen_param_docs.py`. Ranges are checked by the core; a value out of range raises "
             "`InvalidRequestError` (HTTP 400), an unknown name `TypeError`.", ""]
    for title, group, where in GROUPS:
        names = getattr(mbd_rs, group)
        lines += [f"## {title}", "", where, "", "| name | kind | what it does |", "|---|---|---|"]
        for n in names:
            p = mbd_rs.PARAMS[n]
            kind = p["kind"]
            if kind == "text":  # text the model reads: literal, bounded
                kind = f"text (at most {p['max_chars']} characters, {p['max_tokens']} tokens)"
            lines.append(f"| `{n}` | {kind} | {p['help'].replace('|', '&#124;')} |")
        lines.append("")
    return "\n".join(lines)


def render_py() -> str:
    lines = ['"""The keyword arguments of the engine\'s calls, typed: generated from the core\'s registry (`mbd_rs.PARAMS`)',
             "by scripts/gen_param_docs.py; do not edit. Every field is optional (None or absent: the default); ranges",
             'are checked by the core."""',
             "from __future__ import annotations", "", "from typing import Any, Mapping, Optional, Sequence, TypedDict, Union",
             ""]
    for name, groups, what in TYPED:
        lines += ["", f"class {name}(TypedDict, total=False):", f'    """The keyword arguments of {what}."""', ""]
        for g in groups:
            for n in getattr(mbd_rs, g):
                p = mbd_rs.PARAMS[n]
                lines.append(f"    {n}: Optional[{PY_TYPES[p['kind']]}]")
                lines.append(f'    """{p["help"]}"""')
    return "\n".join(lines) + "\n"


def main() -> int:
    outputs = {OUT: render(), PY_OUT: render_py()}
    if "--check" in sys.argv[1:]:
        stale = []
        for path, text in outputs.items():
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    stale.append(path)
        for path in stale:
            print(f"{path} is stale: run python scripts/gen_param_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
