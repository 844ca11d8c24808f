"""Quantized weights on the GPU (`bash benches/gpu/run.sh quant` on the GPU machine): CUDA holds quantized linear layers as candle's quantized tensors and
multiplies them with candle's MMVQ / MMQ kernels (llama.cpp's, which round the activations to 8 bits per block of
32). Each format's logits on CUDA (float32 and bfloat16 compute) against the CPU's exact quantized path on the same
random checkpoint (rows of whole 256-value super-blocks): relative error and top-1 agreement, within bounds set
by the activations' rounding (the CPU's int8_activations path moves them by about as much); the bytes held;
`info.int8_activations` (True on CUDA); and the option the GPU refuses (int8_activations=False: the exact products
are the CPU's). Exit status 1 when a bound fails.

    python benches/gpu/quant.py [--device cuda] [--out gpu_quant.json]
    python benches/gpu/quant.py --device cpu     # a dry run here: candle's quantized tensors on the CPU, float32
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from random_checkpoint import random_checkpoint  # noqa: E402  (tests/random_checkpoint.py)

# (format, max relative error, min top-1) against the CPU's exact quantized logits; float32 | bfloat16 compute
BOUNDS = {"float32": 0.03, "bfloat16": 0.06}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_quant.json"))
    args = ap.parse_args()
    d = str(random_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "m"))
    ids = np.random.default_rng(1).integers(0, 320, 64).tolist()
    rows, ok = [], True
    # on the CPU (a dry run of this script) the same path is candle's quantized tensors under _kernels, f32 only
    dry = args.device == "cpu"
    extra = dict(_kernels=dict(candle_quant=True)) if dry else {}
    for fmt in ["q8_0", "q6_k", "q4_k", "q4_0"]:
        cpu = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=False)
        want = cpu.logits(ids)
        for dtype, bound in BOUNDS.items():
            if dry and dtype != "float32":
                continue
            g = mbd_rs.Engine.load(d, device=args.device, dtype=dtype, quantize=fmt, **extra)
            got = np.asarray(g.logits(ids), dtype=np.float32)
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            top1 = float((got.argmax(1) == want.argmax(1)).mean())
            # the embedding table and the head stay in the compute dtype on a GPU (weight_format "q4_k+bfloat16"):
            # more bytes than the CPU's q8_0
            good = (rel <= bound and top1 >= 0.9 and g.info.weight_format.split("+")[0] == fmt
                    and g.info.int8_activations)
            row = dict(format=fmt, dtype=dtype, device=g.info.device, int8_activations=g.info.int8_activations,
                       max_rel=round(rel, 5), top1=top1,
                       weight_bytes=g.info.weight_bytes, cpu_weight_bytes=cpu.info.weight_bytes, ok=good)
            rows.append(row)
            ok &= good
            print(row, flush=True)
    try:
        mbd_rs.Engine.load(d, device=args.device, quantize="q8_0", int8_activations=False)
        refused = "not refused"
        ok &= dry  # the CPU runs it
    except mbd_rs.InvalidRequestError as e:
        refused = str(e)
        ok &= not dry and "int8_activations=False" in refused
    print("int8_activations=False on the GPU:", refused)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(dict(rows=rows, exact_refused=refused, ok=ok), open(args.out, "w"), indent=1)
    print("OK" if ok else "FAILED", "->", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
