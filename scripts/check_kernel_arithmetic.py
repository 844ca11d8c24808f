"""Check that mbd-rs's CUDA kernels that must give the same bits do the same arithmetic (docs/dev/cuda.md).

The `*_segments` kernels (every segment of a forward in one launch) share their device functions with the
per-segment kernels (`mbd_prep_*`, `mbd_attn_partial_*`, `mbd_attn_combine_*`), and each segment keeps its own
chunking, so a segment's output is meant to be bit-identical either way (batch invariance). This compiles
src/kernels/cuda/kernels.cu to PTX with the given nvcc and compares, for each pair and dtype, the sequence of
floating-point operations (fma/add/mul/sub/max/min/ex2/div/rsqrt/rcp/neg, conversions to and from floats, warp
shuffles) of the two entry points: it must be the same sequence. Address arithmetic and loads may differ.
scripts/build-cuda-wheel.sh runs it before building.

    python scripts/check_kernel_arithmetic.py NVCC [--arch 90]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "crates", "mbd-core", "src", "kernels", "cuda", "kernels.cu")
PAIRS = [("mbd_prep_{}", "mbd_prep_segments_{}"), ("mbd_attn_partial_{}", "mbd_attn_partial_segments_{}"),
         ("mbd_attn_combine_{}", "mbd_attn_combine_segments_{}")]
DTYPES = ["f32", "bf16", "f16"]
ARITH = re.compile(r"(fma|add|sub|mul|max|min|ex2|div|rsqrt|rcp|neg|sqrt|lg2|cvt|shfl)\b")


def float_ops(ptx: str, entry: str) -> list:
    start = ptx.find(f".entry {entry}(")
    if start < 0:
        raise SystemExit(f"{entry} is not in the PTX")
    end = ptx.index("\n}\n", start)
    ops = []
    for line in ptx[start:end].splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][a-z0-9_.]*)\s", line)
        if not m or not ARITH.match(m.group(1)):
            continue
        op = m.group(1)
        # floating-point operations, conversions touching a float type, and shuffles (reductions)
        if re.search(r"\.(f16|bf16|f32|f64)", op) or op.startswith("shfl"):
            ops.append(op)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nvcc")
    ap.add_argument("--arch", default="90")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "k.ptx")
        subprocess.run([args.nvcc, "--ptx", "-O3", "-std=c++17", f"-arch=sm_{args.arch}", "-o", out, SOURCE],
                       check=True)
        ptx = open(out, encoding="utf-8").read()
    bad = []
    for one, together in PAIRS:
        for t in DTYPES:
            a, b = float_ops(ptx, one.format(t)), float_ops(ptx, together.format(t))
            if not a or a != b:
                bad.append(f"{together.format(t)}: {len(b)} floating-point operations, {one.format(t)}: {len(a)}"
                           + ("" if len(a) != len(b) else " (same count, another order)"))
    for line in bad:
        print("differs:", line)
    print(f"kernel arithmetic: {len(PAIRS) * len(DTYPES) - len(bad)}/{len(PAIRS) * len(DTYPES)} pairs the same")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
