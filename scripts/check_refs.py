#!/usr/bin/env python3
"""References that cannot rot: every tracked text file is checked for three kinds of dead pointer.

1. Numbered work items of a tracker that is not in the repo ("issue #N", "(#N)", "session N", "sessionN", with N a
   number): say what the thing is instead, with a date and a commit where "when" matters, or a link to a doc section.
2. Repository paths that do not exist: a word that starts with a top-level folder of the repo (`benches/`,
   `docs/`, `crates/`, ...) or with the core crate's `src/` must name a tracked file or folder (inside a crate, the
   crate's own folders count too). Another project's path is written with its name (`llama.cpp/tools/...`). Words with a
   placeholder (`<topic>`, `{a,b}`, `*`, `$VAR`, `...`) are patterns, not paths, and are skipped; so is anything in
   IGNORE_PATHS (files that a command writes and that are not committed).
3. Markdown links: in a `.md` file, a link's target (`[text](../docs/x.md#anchor)`, relative to the file) must
   exist, and an anchor must be a heading of the page it names (GitHub's heading ids).

    python3 scripts/check_refs.py          # the check (scripts/lint.sh runs it); exit 1 and one line per finding
    python3 scripts/check_refs.py FILE...  # only these files
    python3 scripts/check_refs.py --root DIR  # another git tree (tests/test_refs.py plants errors in one)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = "crates/mbd-core"

# work items: "issue #N", "issues #N/#M", "session N", "sessions N-M", "sessionN", a bare "(#N)" or " #N" (N a number)
WORK_ITEM = re.compile(
    r"\bissues?\s+#?\d+|\bsessions?[ _-]?\d+|(?<![\w&$/#{-])#\d{1,3}(?![\w-])",
    re.IGNORECASE,
)
TOP = ("benches", "docs", "crates", "scripts", "tests", "python", "training", "examples", "models", ".ci", "src")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./+-]*[\w+-]/?)" % "|".join(re.escape(t) for t in TOP))
PLACEHOLDER = re.compile(r"[<>{}*$]|\.\.\.")
# written by a command, never committed (a benchmark's scratch, a build's output, a test's temporary tree)
IGNORE_PATHS = {
    "python/mbd_rs/_core.abi3.so",
    "crates/mbd-core/target",
}
# the check and its test, which spell out what they look for
PLANTS = {"scripts/check_refs.py", "tests/test_refs.py"}
# files whose text is data or generated elsewhere
SKIP_FILES = {"Cargo.lock", "LICENSE"}
SKIP_SUFFIXES = {".png", ".gz", ".safetensors", ".gguf", ".bin", ".so", ".ico", ".woff2"}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def existing(files: list[str]) -> set[str]:
    have = set(files)
    for f in files:
        parts = f.split("/")
        for i in range(1, len(parts)):
            have.add("/".join(parts[:i]))
    return have


def path_ok(word: str, have: set[str], here: str) -> bool:
    word = word.rstrip("/.")
    if word in IGNORE_PATHS or PLACEHOLDER.search(word):
        return True
    candidates = [word]
    # inside a crate, a path may be written relative to the crate (`tests/batching.rs`, `src/kernels/cuda.rs`);
    # anywhere, `src/` means the core crate's sources
    crate = re.match(r"crates/[^/]+/", here)
    if crate:
        candidates.append(crate.group(0) + word)
    if word.startswith("src/"):
        candidates.append(f"{CORE}/{word}")
    for c in candidates:
        if c in have:
            return True
        # a Rust path written with the module's file name: `kernels/panels` for `kernels/panels.rs` or `/mod.rs`
        if any(f"{c}{ext}" in have for ext in (".rs", ".py", ".md", ".sh")):
            return True
    return False


MD_LINK = re.compile(r"\]\(([^()\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (letters, digits, `-` and `_` kept), spaces to `-`."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def md_links(rel: str, line: str, have: set[str]) -> list[str]:
    found = []
    for m in MD_LINK.finditer(line):
        target = m.group(1)
        if re.match(r"[a-z]+:", target) or target.startswith("<"):
            continue  # a URL, a mail address
        path, _, anchor = target.partition("#")
        dest = (Path(rel).parent / path).as_posix() if path else rel
        dest = str(Path(dest)).replace("\\", "/")
        norm = []
        for part in dest.split("/"):
            if part == "..":
                if norm:
                    norm.pop()
            elif part not in ("", "."):
                norm.append(part)
        dest = "/".join(norm)
        if path and dest not in have:
            found.append(f"{rel}: link to {target!r}: {dest!r} is not a file or folder of the repository")
        elif anchor and dest.endswith(".md") and anchor not in anchors(ROOT / dest):
            found.append(f"{rel}: link to {target!r}: {dest} has no heading with the id {anchor!r}")
    return found


def check(files: list[str], have: set[str]) -> list[str]:
    findings = []
    for rel in files:
        if rel in SKIP_FILES or Path(rel).suffix in SKIP_SUFFIXES or rel in PLANTS:
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        html = rel.endswith((".html", ".css", ".svg"))
        for n, line in enumerate(text.splitlines(), 1):
            for m in WORK_ITEM.finditer(line):
                if html and m.group(0).startswith("#"):
                    continue  # colours
                findings.append(f"{rel}:{n}: numbered work item {m.group(0)!r}: say what it is (a name, a date "
                                "and commit, or a doc link)")
            if rel.endswith(".md"):
                findings += [f.replace(f"{rel}:", f"{rel}:{n}:", 1) for f in md_links(rel, line, have)]
            if rel.endswith(".json"):
                continue
            for m in PATH.finditer(line):
                if line[m.end():m.end() + 1] in ("{", "<", "*", "$"):
                    continue  # the word goes on as a pattern (`x_{a,b}.json`)
                if not path_ok(m.group(1), have, rel):
                    findings.append(f"{rel}:{n}: {m.group(1)!r} is not a file or folder of the repository")
    return findings


def main(argv: list[str]) -> int:
    global ROOT
    if argv[:1] == ["--root"]:
        ROOT, argv = Path(argv[1]).resolve(), argv[2:]
    files = tracked()
    have = existing(files)
    chosen = argv or files
    findings = check(chosen, have)
    for f in findings:
        print(f)
    if findings:
        print(f"check_refs: {len(findings)} dead reference(s)", file=sys.stderr)
        return 1
    print(f"check_refs: {len(chosen)} files, no dead references")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
