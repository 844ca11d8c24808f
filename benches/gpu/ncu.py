"""One decode forward's mbd-rs kernels under Nsight Compute, run by `bash benches/gpu/run.sh ncu` on the GPU machine
(which needs `ncu` on its PATH or under /usr/local/cuda*/bin).

A 2-layer Qwen3 with the SDAR-1.7B layer shape (hidden 2048, 16 heads, 8 KV heads, head_dim 128, intermediate
6144, vocab 151936; random bf16 weights) is written on the spot; `bench_forward(P, W, 2)` then runs a P-token
prefill and two W-row decode forwards, which `ncu` (started by run.sh with a kernel-name filter) profiles: per
kernel launch its grid, achieved occupancy, throughput against the chip's peaks and the warps' stall reasons.
"""
import argparse
import os

import torch

import mbd_rs

import speed

SHAPE = dict(speed.SHAPES["sdar-1.7b"], num_hidden_layers=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/mbd-gpu-ncu")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        speed.SHAPES["ncu"] = SHAPE
        hf = speed.make_checkpoint("ncu", args.dir, torch.device(args.device), torch.bfloat16)
        del hf
        torch.cuda.empty_cache()
    eng = mbd_rs.Engine.load(args.dir, device=args.device)
    t = eng._core.bench_forward(args.prefix, args.window, 2)
    print(f"P {args.prefix} W {args.window}: forwards {[round(1e3 * x, 3) for x in t]} ms", flush=True)


if __name__ == "__main__":
    main()
