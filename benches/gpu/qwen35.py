"""Qwen3.5 hybrids on the GPU: mbd-rs's Gated DeltaNet kernels (kernels/cuda/kernels.cu's
`mbd_gdn_rows` and `mbd_gdn_scan_*`: a window's recurrence rows, then the recurrence from the committed state with
the gated norm, or a commit's state), run by `bash benches/gpu/run.sh qwen35` on the GPU machine (or anywhere with --device cpu, a
dry run of the same script on the host's functions).

1. Parity at Qwen3.5's head shape (the committed parity fixtures' heads are 8-16 wide, which the kernels do not
   take: those run the host's functions on every device): a random hybrid (4 layers: 3 Gated DeltaNet + 1 gated
   attention; GDN 4 key / 8 value heads of 128, so Hv > Hk; attention 4 / 2 heads of 256 with a quarter rotated;
   randomised norms, A_log and dt_bias), float32. Logits through the cache (a prefix committed in blocks, then the
   rest as one window) against transformers float32 on the same device over the whole sequence, causal and
   block-causal (the 4-D mask on the attention layer only). Bound: 1e-3 relative (float32, as parity.py's).
2. The trained twin (models/mbd-qwen35-tiny, heads of 32: the kernels run) on the device in float32: every case of
   tests/fixtures/decode/qwen35_twin.json (the reference decoder over transformers float32 on the CPU), cache on
   and off: tokens and forward counts (a kernel's other summation order may flip a near-tie: the count of equal
   cases is reported and must reach 90%); cache on = cache off exactly (a forward's scan and a commit's are the same
   kernel); 8 streams batched = each alone.
3. Speed: one window forward (prefix:window cases) of the Qwen3.5-0.8B shape (benches/forward/qwen35_forward.py's random
   checkpoint), bfloat16, against transformers eager on the same device (its torch fallbacks for the convolution and
   the chunked delta rule) and the bandwidth floor (weight bytes over a device-to-device copy's bandwidth).

    python benches/gpu/qwen35.py [--device cuda] [--cases 512:1,512:32,2048:32,0:32] [--out FILE]
Writes one JSON (--out) and exits non-zero when a bound is missed.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch
import transformers

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benches", "forward"))
sys.path.insert(0, os.path.join(ROOT, "benches", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from fixture_params import generate_kwargs  # noqa: E402
from qwen35_forward import make  # noqa: E402
from speed import copy_bandwidth, sync  # noqa: E402

SHAPE_PARITY = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4,
                    linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=False,
                    max_position_embeddings=4096, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
BOUND = 1e-3


def block_mask(n, b, dev):
    """transformers' additive 4-D mask of block-causal attention (blocks of b from position 0)."""
    blk = torch.arange(n, device=dev) // b
    allowed = blk[None, :] <= blk[:, None]
    return torch.zeros(n, n, device=dev).masked_fill(~allowed, float("-inf"))[None, None]


def parity(args, dev, report):
    path = "/tmp/mbd-gpu/qwen35-parity"
    make(path, SHAPE_PARITY["num_hidden_layers"], SHAPE_PARITY, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").to(dev).eval()
    eng = mbd_rs.Engine.load(path, device=args.device, dtype="float32")
    n = 72
    ids = torch.randint(0, SHAPE_PARITY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    ok = True
    for attention, b in [("causal", 1), ("block_causal", 4)]:
        with torch.no_grad():
            kw = {}
            if attention == "block_causal":
                kw["attention_mask"] = {"full_attention": block_mask(n, b, dev), "linear_attention": None}
            want = hf(ids.to(dev), **kw).logits[0].double().cpu().numpy()
        for prefix in [0, 8, 16, 40, 64]:
            got = np.asarray(eng.logits(ids[0].tolist(), prefix_len=prefix, attention=attention, block_size=b),
                             dtype=np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            agree = float((got.argmax(-1) == want.argmax(-1)).mean())
            good = err <= BOUND
            ok &= good
            report["parity"].append(dict(attention=attention, prefix=prefix, rel_err=err, argmax_agree=agree, ok=good))
            print(f"parity {attention:12s} prefix {prefix:2d}: rel err {err:.2e} argmax agree {agree:.3f}"
                  f"{'' if good else '  <-- over ' + str(BOUND)}", flush=True)
    return ok


def twin(args, report):
    fx = json.load(open(os.path.join(ROOT, "tests", "fixtures", "decode", "qwen35_twin.json")))
    eng = mbd_rs.Engine.load(os.path.join(ROOT, "models", "mbd-qwen35-tiny"), device=args.device, dtype="float32")
    same = {True: 0, False: 0}
    on_off = 0
    for c in fx["cases"]:
        kw = generate_kwargs(c["params"])
        outs = {}
        for cache in (True, False):
            o = eng.generate(c["prompt_ids"], max_tokens=fx["max_tokens"], use_cache=cache, **kw)
            outs[cache] = (o.token_ids, o.usage.forward_passes)
            same[cache] += outs[cache] == (c["tokens"], c["forward_passes"])
        on_off += outs[True] == outs[False]
    n = len(fx["cases"])
    prompts = [c["prompt_ids"] for c in fx["cases"][::6][:8]]
    lone = [eng.generate(p, max_tokens=40, block_size=8).token_ids for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = eng.generate(prompts[i], max_tokens=40, block_size=8).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = dict(cases=n, reference_cache=same[True], reference_nocache=same[False], cache_on_equals_off=on_off,
               batched_equals_lone=got == lone)
    ok = min(same.values()) >= 0.9 * n and on_off == n and got == lone
    row["ok"] = ok
    report["twin"] = row
    print(f"twin: reference = device on {same[True]}/{n} (cache) {same[False]}/{n} (no cache); cache on = off "
          f"{on_off}/{n}; 8 streams batched = alone: {got == lone}", flush=True)
    return ok


def torch_ms(hf, dev, p, w, reps):
    ids = torch.randint(0, 240000, (1, p + w), generator=torch.Generator().manual_seed(0)).to(dev)
    out = []
    with torch.no_grad():
        base = transformers.DynamicCache(config=hf.config)
        if p:
            hf(ids[:, :p], past_key_values=base, use_cache=True)
        for i in range(reps + 1):
            cache = copy.deepcopy(base)
            sync(dev)
            t = time.perf_counter()
            hf(ids[:, p:], past_key_values=cache, use_cache=True, position_ids=torch.arange(p, p + w, device=dev)[None])
            sync(dev)
            if i:
                out.append(time.perf_counter() - t)
    return out


def speed(args, dev, report):
    path = "/tmp/mbd-gpu/qwen3.5-0.8b-shape"
    if not os.path.exists(os.path.join(path, "config.json")):
        make(path, args.layers)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    eng = mbd_rs.Engine.load(path, device=args.device, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                           attn_implementation="eager").to(dev).eval()
    bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (256 << 20))
    floor = 1e3 * eng.info.weight_bytes / bw
    report["speed"] = dict(dtype=dtype, weight_bytes=eng.info.weight_bytes, copy_bandwidth_gbs=round(bw / 1e9, 1),
                           floor_ms=round(floor, 3), rows=[])
    for case in args.cases.split(","):
        p, w = map(int, case.split(":"))
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours += eng._core.bench_forward(p, w, args.reps + 1)[1:]
            theirs += torch_ms(hf, dev, p, w, args.reps)
        o, t = 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs)
        report["speed"]["rows"].append(dict(prefix=p, window=w, mbd_rs_ms=round(o, 3), torch_eager_ms=round(t, 3),
                                            vs_floor=round(o / floor, 2), vs_torch=round(o / t, 3)))
        print(f"speed prefix {p:5d} W {w:3d}: mbd-rs {o:8.2f} ms ({o / floor:.2f}x the {floor:.2f} ms floor), "
              f"torch eager {t:8.2f} ms = {o / t:.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="512:1,512:32,2048:32,0:32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: parity,twin,speed")
    ap.add_argument("--out", default="gpu_qwen35.json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    os.makedirs("/tmp/mbd-gpu", exist_ok=True)
    report = {"device": args.device, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "core": mbd_rs._core.__name__, "torch": torch.__version__, "transformers": transformers.__version__,
              "parity": []}
    skip = set(filter(None, args.skip.split(",")))
    ok = True
    if "parity" not in skip:
        ok &= parity(args, dev, report)
    if "twin" not in skip:
        ok &= twin(args, report)
    if "speed" not in skip:
        speed(args, dev, report)
    report["ok"] = bool(ok)
    json.dump(report, open(args.out, "w"), indent=1)
    print("qwen35:", "ok" if ok else "BOUND MISSED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
