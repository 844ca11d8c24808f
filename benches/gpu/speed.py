"""GPU speed, run by `bash benches/gpu/run.sh speed` (and its other speed stages) on the GPU machine, or with
--device cpu --shape tiny as a dry run.

A random-weight bfloat16 checkpoint of a real model's shape is made on the spot with transformers (--shape sdar-1.7b:
Qwen3, hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab 151936; qwen3-8b: the
SDAR-8B / TraDo-8B shape). Then, side by side in one process, interleaved over --rounds rounds:
- one decode forward, a W-token window over a P-token KV cache, logits for every window row: mbd-rs
  (`bench_forward`, which waits for the device) against PyTorch eager transformers (the same model object the
  checkpoint was written from, bf16, eager attention, DynamicCache, torch.cuda.synchronize() before the clock stops);
- the floor: the weight bytes over the device's copy bandwidth (a large device-to-device copy, read + write bytes);
- end to end: tokens/s and forwards of one generation (multi-block, and block size 1 = AR), and the throughput of
  1 / 8 / 32 concurrent streams sharing forwards (continuous batching).
`--ab candle_ops`: more engines on the same checkpoint, each with a part of mbd-rs switched off (VARIANTS;
candle_ops: candle's ops in place of every mbd-rs CUDA kernel), timed in the same rounds (columns <variant>_ms
and vs_<variant> = mbd-rs / variant).
Writes one JSON (--out).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import numpy as np
import torch
import transformers

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {
    "sdar-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=151936, tie_word_embeddings=True),
}

# --ab variants: mbd-rs loaded otherwise (`Engine.load(**kwargs)`): one part switched off, or quantized weights
VARIANTS = {"candle_ops": dict(_kernels=dict(cuda_fused=False)),  # candle's ops in place of every mbd-rs CUDA kernel
            # every segment of a forward in one launch per attention kernel
            "segments": dict(_kernels=dict(cuda_segments=True)),
            # and a CUDA graph replayed per forward shape
            "graphs": dict(_kernels=dict(cuda_segments=True, cuda_graphs=True)),
            # quantized linear layers: candle's quantized tensors and kernels (MMVQ / MMQ)
            "q8_0": dict(quantize="q8_0"), "q6_k": dict(quantize="q6_k"), "q4_k": dict(quantize="q4_k")}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_checkpoint(shape, path, dev, dtype):
    cfg = transformers.Qwen3Config(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   eos_token_id=151643, bos_token_id=151643, attn_implementation="eager",
                                   **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    c = json.load(open(os.path.join(path, "config.json")))
    c.update(block_size=32, mask_token_id=151665)  # an SDAR-like block-diffusion profile
    json.dump(c, open(os.path.join(path, "config.json"), "w"), indent=1)
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "parity", "qwen2_gqa_tied", "tokenizer.json"), path)
    return model


def copy_bandwidth(dev, nbytes=2 << 30):
    """Bytes moved per second (read + write) by a large device-to-device copy: the memory floor's bandwidth."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(dev)
        t = time.perf_counter()
        b.copy_(a)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def torch_forward_ms(hf, dev, p, w, reps):
    ids = torch.randint(0, 150000, (1, p + w), generator=torch.Generator().manual_seed(0)).to(dev)
    out = []
    with torch.no_grad():
        cache = transformers.DynamicCache(config=hf.config)
        if p:
            hf(ids[:, :p], past_key_values=cache, use_cache=True)
        pos = torch.arange(p, p + w, device=dev)[None]
        mask = torch.ones(1, p + w, dtype=torch.long, device=dev)
        for i in range(reps + 1):
            sync(dev)
            t = time.perf_counter()
            hf(ids[:, p:], past_key_values=cache, use_cache=True, position_ids=pos, attention_mask=mask)
            sync(dev)
            if i:
                out.append(time.perf_counter() - t)
            cache.crop(-w)
    return out


def streams_throughput(eng, k, max_tokens, vocab):
    rng = np.random.default_rng(k)
    prompts = [rng.integers(0, vocab, 64).tolist() for _ in range(k)]
    counts = [0] * k

    def run(i):
        for chunk in eng.stream(prompts[i], max_tokens=max_tokens, temperature=0.0, early_stop=False):
            counts[i] += len(chunk.token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    return {"streams": k, "tokens": sum(counts), "seconds": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="sdar-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="/tmp/mbd-gpu")
    ap.add_argument("--cases", default="512:1,512:4,512:8,512:16,512:32,512:64,2048:1,2048:4,2048:16,2048:32,2048:64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--e2e", action="store_true", help="also end-to-end generation and 1/8/32 concurrent streams")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ab", default="", help="comma-separated variants timed side by side: " + ", ".join(VARIANTS))
    ap.add_argument("--e2e-engines", default="mbd_rs,candle_ops", help="engines of the end-to-end runs")
    args = ap.parse_args()
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"gpu_speed_{args.shape}.json")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    path = os.path.join(args.dir, args.shape)
    t0 = time.time()
    hf = make_checkpoint(args.shape, path, dev, dtype)
    made = time.time() - t0
    eng = mbd_rs.Engine.load(path, device=args.device)
    engines = {"mbd_rs": eng}
    for name in filter(None, (args.ab or "").split(",")):
        engines[name] = mbd_rs.Engine.load(path, device=args.device, **VARIANTS[name])
    info = eng.info
    report = {"device": args.device, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "shape": args.shape, "params": info.num_parameters, "weight_bytes": info.weight_bytes,
              "dtype": info.dtype, "core": mbd_rs._core.__name__, "checkpoint_seconds": round(made, 1),
              "torch": torch.__version__, "transformers": transformers.__version__, "forward": [], "e2e": []}
    bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (256 << 20))
    floor_ms = 1e3 * info.weight_bytes / bw
    report.update(copy_bandwidth_gbs=round(bw / 1e9, 1), floor_ms=round(floor_ms, 3),
                  variant_weight_bytes={k: e.info.weight_bytes for k, e in engines.items()})
    print(f"{report['gpu']} {args.shape}: {info.num_parameters / 1e9:.2f}B params, {info.weight_bytes / 1e9:.2f} GB "
          f"{info.dtype}; copy bandwidth {bw / 1e9:.0f} GB/s -> floor {floor_ms:.2f} ms", flush=True)
    for case in args.cases.split(","):
        p, w = map(int, case.split(":"))
        times = {k: [] for k in engines}
        theirs = []
        for _ in range(args.rounds):
            for k, e in engines.items():
                times[k] += e._core.bench_forward(p, w, args.reps + 1)[1:]
            theirs += torch_forward_ms(hf, dev, p, w, args.reps)
        o, t = 1e3 * statistics.median(times["mbd_rs"]), 1e3 * statistics.median(theirs)
        row = dict(prefix=p, window=w, mbd_rs_ms=round(o, 3), torch_eager_ms=round(t, 3),
                   vs_floor=round(o / floor_ms, 2), vs_torch=round(o / t, 3))
        extra = ""
        for name in engines:
            if name != "mbd_rs":
                c = 1e3 * statistics.median(times[name])
                # a variant's own floor: its weight bytes (quantized: fewer) over the same bandwidth
                own_floor = 1e3 * engines[name].info.weight_bytes / bw
                row.update({f"{name}_ms": round(c, 3), f"vs_{name}": round(o / c, 3),
                            f"{name}_vs_floor": round(c / own_floor, 2), f"{name}_vs_torch": round(c / t, 3)})
                extra += f"  {name} {c:6.2f} ms ({o / c:.2f}; {c / own_floor:.2f}x its floor)"
        report["forward"].append(row)
        print(f"P {p:5d} W {w:3d}: mbd-rs {o:8.2f} ms ({o / floor_ms:5.2f}x floor)  torch eager {t:8.2f} ms  "
              f"mbd-rs/torch {o / t:.2f}{extra}", flush=True)
    if args.e2e:
        prompt = np.random.default_rng(1).integers(0, 150000, 64).tolist()
        e2e = {k: v for k, v in engines.items() if k in args.e2e_engines.split(",")}
        for name, e in e2e.items():
            for label, kw in (("multi-block", {}), ("ar (block size 1)", {"block_size": 1})):
                e.generate(prompt, max_tokens=16, temperature=0.0, early_stop=False, **kw)  # warm-up
                c = e.generate(prompt, max_tokens=256, temperature=0.0, early_stop=False, **kw)
                u = c.usage
                row = dict(engine=name, mode=label, tokens=u.completion_tokens, forwards=u.forward_passes,
                           tokens_per_s=round(u.tokens_per_second, 1), decode_ms=round(u.decode_ms, 1))
                report["e2e"].append(row)
                print(f"e2e {name} {label:18s}: {row}", flush=True)
        report["streams"] = []
        for k in (1, 8, 32):
            for name, e in e2e.items():
                row = dict(engine=name, **streams_throughput(e, k, 128, 150000))
                report["streams"].append(row)
                print(f"streams {k:2d}: {row}", flush=True)
    # (captured, replayed, refused) CUDA graphs of each engine (zeros without the cuda_graphs switch)
    report["graph_stats"] = {k: e.graph_stats for k, e in engines.items()}
    print("graph_stats", report["graph_stats"], flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
