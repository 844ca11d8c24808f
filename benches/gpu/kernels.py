"""Where one decode forward's time goes on the GPU, run by `bash benches/gpu/run.sh profile` on the GPU machine (not
named profile.py: that would shadow the standard library module cProfile imports).

Nsight Systems need not be installed there; PyTorch's profiler is (it comes with PyTorch), and its CUPTI activity tracing records every kernel the
process launches, including candle's and cuBLAS's launched by mbd-rs through the driver API. For each window size
(--cases P:W, the SDAR-1.7B shape of speed.py, random bf16 weights): the wall time of one forward (under the
profiler), the number of kernels it launches, the summed kernel time (GPU busy time; wall minus busy is time the
GPU waited for the host), and the kernels that cost most. `--configs fused,candle`: the same for each load
configuration (`fused` = `stacked` = the default; `candle`: candle's ops in place of mbd-rs's CUDA kernels;
`separate`: one product per q/k/v and gate/up layer instead of the stacked one). Writes one
JSON (--out) and prints a short table.
"""
import argparse
import collections
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speed  # noqa: E402  (same checkpoint maker)

import mbd_rs  # noqa: E402

# load configurations (`Engine.load(..., _kernels=...)`)
CONFIGS = {"fused": {}, "candle": dict(cuda_fused=False), "stacked": {}, "separate": dict(stack=False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="sdar-1.7b", choices=sorted(speed.SHAPES))
    ap.add_argument("--cases", default="512:1,512:32,512:64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/mbd-gpu")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_profile.json"))
    ap.add_argument("--configs", default="fused", help="comma-separated: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    path = os.path.join(args.dir, args.shape)
    hf = speed.make_checkpoint(args.shape, path, dev, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    report = {"gpu": torch.cuda.get_device_name(dev), "shape": args.shape, "cases": []}
    for config in args.configs.split(","):
        eng = mbd_rs.Engine.load(path, device="cuda", _kernels=CONFIGS[config])
        profile_cases(eng, config, args, report)
        del eng
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", args.out)


def profile_cases(eng, config, args, report):
    for case in args.cases.split(","):
        p, w = map(int, case.split(":"))
        eng._core.bench_forward(p, w, 3)  # warm-up (module loads, cuBLAS handles)
        # bench_forward fills the P-token cache (a prefill) before its timed forwards: profile a call with 1 and
        # one with 1 + reps forwards and keep the difference, the reps decode forwards alone
        runs = []
        for n in (1, 1 + args.reps):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                walls = eng._core.bench_forward(p, w, n)
            runs.append([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for sign, evs in ((-1, runs[0]), (1, runs[1])):
            for e in evs:
                by_name[e.name][0] += sign
                by_name[e.name][1] += sign * e.device_time_total / 1e3  # ms
        n_kernels = sum(v[0] for v in by_name.values())
        busy = sum(v[1] for v in by_name.values()) / args.reps
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
        row = dict(config=config, prefix=p, window=w, wall_ms=round(1e3 * statistics.median(walls[1:]), 3),
                   kernels_per_forward=round(n_kernels / args.reps, 1),
                   gpu_busy_ms=round(busy, 3),
                   top=[dict(name=n[:120], per_forward=c / args.reps, ms_per_forward=round(ms / args.reps, 3))
                        for n, (c, ms) in top])
        report["cases"].append(row)
        print(f"{config}: P {p} W {w}: wall {row['wall_ms']:.2f} ms, {row['kernels_per_forward']:.0f} kernels/forward, "
              f"GPU busy {busy:.2f} ms", flush=True)
        for t in row["top"]:
            print(f"   {t['ms_per_forward']:8.3f} ms  x{t['per_forward']:5.0f}  {t['name'][:90]}")


if __name__ == "__main__":
    main()
