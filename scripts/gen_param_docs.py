#!/usr/bin/env python3
"""Write docs/parameters.md, the table of every parameter a caller can pass, from the core's registry
(`mbd_rs.PARAMS` and its groups), so the manual cannot drift from the code. tests/test_docs.py checks that the file
is what this script writes.

    python scripts/gen_param_docs.py            # rewrite docs/parameters.md
    python scripts/gen_param_docs.py --check    # exit 1 if it is stale
"""
from __future__ import annotations

import os
import sys

import mbd_rs

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "parameters.md")

GROUPS = [
    ("Generation", "GENERATION_PARAMS",
     "`Engine.generate` / `stream` / `chat` / `stream_chat` keyword arguments; the server's body fields (OpenAI's "
     "names where it has them, the rest as extensions); `mbd-rs generate` / `chat` / `bench` flags."),
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
            lines.append(f"| `{n}` | {p['kind']} | {p['help'].replace('|', '&#124;')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{OUT} is stale: run python scripts/gen_param_docs.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
