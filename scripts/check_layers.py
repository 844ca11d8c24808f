#!/usr/bin/env python3
"""The floor plan of crates/mbd-core/src, enforced: imports run only downward.

The allowed order is declared once, in docs/dev/architecture.md, in the fenced block marked `layers`: one floor per
line, bottom first, as `wing: file file ...` (paths under src/ without `.rs`; `a/mod` is the folder's module file).
A file may refer only to files on the lines above its own (`crate::` and `$crate::` paths, `super::sibling`). The
check fails on an upward or sideways reference, on a file that is on no line (outside any wing), on a line that
names a file that is not there, and on a wing folder file listed under another wing.

    python3 scripts/check_layers.py            # the check (scripts/lint.sh runs it)
    python3 scripts/check_layers.py --report   # also: files, references, circles and floors of the graph
    python3 scripts/check_layers.py --src DIR --plan FILE   # another tree (tests/test_layers.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def module_of(rel: Path) -> str:
    """src-relative file -> module path ('' for lib.rs, 'a' for a/mod.rs or a.rs, 'a::b' for a/b.rs)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "mod":
        parts.pop()
    if parts == ["lib"]:
        return ""
    return "::".join(parts)


def plan_name(rel: Path) -> str:
    return rel.with_suffix("").as_posix()


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        # drop // comments that are not inside a string literal (good enough for this code base: no "//" in the
        # paths we look for)
        i = line.find("//")
        while i >= 0 and line[:i].count('"') % 2 == 1:
            i = line.find("//", i + 2)
        out.append(line if i < 0 else line[:i])
    return "\n".join(out)


def expand(text: str, start: int) -> list[str]:
    """Paths of a `crate::...` reference whose text starts at `start` (just after `crate::`), groups expanded."""
    m = re.match(rf"{IDENT}(::{IDENT})*(::)?", text[start:])
    head = m.group(0) if m else ""
    pos = start + len(head)
    if head.endswith("::") or head == "":
        if pos < len(text) and text[pos] == "{":
            depth, j = 0, pos
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            inner = text[pos + 1 : j]
            items, depth, cur = [], 0, ""
            for ch in inner:
                if ch == "," and depth == 0:
                    items.append(cur)
                    cur = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                cur += ch
            items.append(cur)
            paths = []
            for it in items:
                it = it.strip()
                if not it:
                    continue
                sub = expand(it, 0) if re.match(IDENT, it) else []
                paths += [head + p for p in sub] or [head.rstrip(":")]
            return paths
        head = head.rstrip(":")
    return [head] if head else []


def inline_modules(code: str) -> list[tuple[int, int]]:
    """Byte ranges of the inline modules (`mod name { ... }`) of a file's code."""
    spans = []
    for m in re.finditer(rf"\bmod\s+\$?{IDENT}\s*\{{", code):
        depth, j = 0, m.end() - 1
        while j < len(code):
            depth += code[j] == "{"
            depth -= code[j] == "}"
            if depth == 0:
                break
            j += 1
        spans.append((m.start(), j))
    return spans


def references(text: str, module: str, siblings: set[str]) -> list[str]:
    """Module paths (as written, from the crate root) that a file's code refers to."""
    code = strip_comments(text)
    refs = []
    for m in re.finditer(r"(?<![A-Za-z0-9_])\$?crate::", code):
        refs += expand(code, m.end())
    # super:: from the file itself reaches its parent module (super:: inside an inline module reaches this file)
    inline = inline_modules(code)
    parent = module.rsplit("::", 1)[0] if "::" in module else ""
    for m in re.finditer(rf"(?<![A-Za-z0-9_:])super::({IDENT}|\*|\{{)", code):
        if any(a <= m.start() <= b for a, b in inline):
            continue
        # `super::{a, b::c}`: each item; `super::*`: the parent itself
        names = [p.split("::")[0] for p in expand(code, m.start(1))] if m.group(1) == "{" else [m.group(1)]
        for name in names:
            refs.append((f"{parent}::{name}" if parent else name) if name in siblings else parent)
    return refs


def resolve(path: str, modules: dict[str, Path]) -> Path | None:
    parts = path.split("::") if path else []
    for n in range(len(parts), -1, -1):
        key = "::".join(parts[:n])
        if key in modules:
            return modules[key]
    return None


def read_plan(plan: Path) -> list[tuple[str, list[str]]]:
    text = plan.read_text()
    m = re.search(r"```layers\n(.*?)```", text, flags=re.S)
    if not m:
        sys.exit(f"{plan}: no ```layers block (the floor plan this check reads)")
    floors = []
    for raw in m.group(1).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        wing, _, files = line.partition(":")
        floors.append((wing.strip(), files.split()))
    return floors


def sccs(nodes: list[Path], edges: dict[Path, set[Path]]) -> list[list[Path]]:
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    out: list[list[Path]] = []
    counter = [0]

    def visit(v: Path) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def depth(nodes: list[Path], edges: dict[Path, set[Path]]) -> int:
    """Floors of the graph: the longest chain of references, counted in files (circles collapsed)."""
    comp_of = {}
    comps = sccs(nodes, edges)
    for i, c in enumerate(comps):
        for v in c:
            comp_of[v] = i
    memo: dict[int, int] = {}

    def d(c: int) -> int:
        if c not in memo:
            memo[c] = 1 + max(
                (d(comp_of[w]) for v in comps[c] for w in edges.get(v, ()) if comp_of[w] != c), default=0
            )
        return memo[c]

    return max((d(i) for i in range(len(comps))), default=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=ROOT / "crates/mbd-core/src")
    ap.add_argument("--plan", type=Path, default=ROOT / "docs/dev/architecture.md")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--no-plan", action="store_true", help="only the report (a tree with no floor plan yet)")
    a = ap.parse_args()

    files = sorted(p.relative_to(a.src) for p in a.src.rglob("*.rs"))
    modules = {module_of(f): f for f in files}
    edges: dict[Path, set[Path]] = {}
    for f in files:
        # a folder's module (mod.rs): its siblings are in the folder's parent
        home = f.parent.parent if f.name == "mod.rs" else f.parent
        siblings = {g.with_suffix("").name for g in files if g.parent == home} | {
            g.parent.name for g in files if g.parent.parent == home and g.name == "mod.rs"
        }
        for ref in references((a.src / f).read_text(), module_of(f), siblings):
            t = resolve(ref, modules)
            if t is not None and t != f:
                edges.setdefault(f, set()).add(t)

    problems: list[str] = []
    floor_of: dict[Path, int] = {}
    wing_of: dict[Path, str] = {}
    if not a.no_plan:
        for i, (wing, names) in enumerate(read_plan(a.plan)):
            for n in names:
                p = Path(n + ".rs")
                if p not in modules.values():
                    problems.append(f"{a.plan.name}: floor {i + 1} ({wing}) names {n}, which is not in {a.src}")
                    continue
                if p in floor_of:
                    problems.append(f"{a.plan.name}: {n} is on two floors")
                floor_of[p], wing_of[p] = i, wing
                if len(p.parts) > 1 and p.parts[0] != wing:
                    problems.append(f"{n} is in the folder {p.parts[0]}/ but listed under the wing '{wing}'")
        for f in files:
            if f not in floor_of:
                problems.append(f"{plan_name(f)} is outside every wing: add it to a floor of {a.plan.name}")
        for f, ts in sorted(edges.items()):
            for t in sorted(ts):
                if f in floor_of and t in floor_of and floor_of[t] >= floor_of[f]:
                    how = "sideways (same floor)" if floor_of[t] == floor_of[f] else "upward"
                    problems.append(
                        f"{plan_name(f)} ({wing_of[f]}, floor {floor_of[f] + 1}) refers {how} to "
                        f"{plan_name(t)} ({wing_of[t]}, floor {floor_of[t] + 1})"
                    )

    circles = [c for c in sccs(files, edges) if len(c) > 1]
    if a.report:
        n_edges = sum(len(v) for v in edges.values())
        print(f"files {len(files)}, references (file to file) {n_edges}, floors {depth(files, edges)}")
        print(f"circles {len(circles)}" + "".join(f"\n  {sorted(plan_name(p) for p in c)}" for c in circles))
        if not a.no_plan:
            up = sum(1 for p in problems if "refers" in p)
            print(f"upward or sideways references {up}")
        sizes = sorted(((len((a.src / f).read_text().splitlines()), plan_name(f)) for f in files), reverse=True)
        print("largest files: " + ", ".join(f"{n} {s}" for s, n in sizes[:8]), flush=True)
    for p in problems:
        print(f"layers: {p}", file=sys.stderr)
    if circles and not a.no_plan:
        for c in circles:
            print(f"layers: circle {sorted(plan_name(p) for p in c)}", file=sys.stderr)
    if (problems or circles) and not a.no_plan:
        print(f"layers: {len(problems)} problem(s); the floor plan is the ```layers block of {a.plan}", file=sys.stderr)
        return 1
    if not a.no_plan:
        print(f"layers: {len(files)} files on {len(read_plan(a.plan))} floors, every reference downward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
