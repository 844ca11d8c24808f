"""ISD (speculative="isd") against AR decoding of the same weights, side by side, interleaved.

One engine per configuration (the checkpoint loaded as I-DLM checkpoints are: causal attention, shifted logits);
each round runs every mode once, in turn, on the same prompt: AR (one token per forward) and ISD with a few
strides. Reports the median time per generation, tokens per forward, milliseconds per forward, and the
break-even tokens per forward of each stride (its forward's cost over AR's): ISD beats AR where the model's drafts
are accepted often enough to write more tokens per forward than that.

    python benches/decoding/isd.py MODEL_DIR [--rounds 5] [--tokens 48] [--configs bf16,q8_0+int8] [--device cuda]
        [--out benches/results/decoding/isd_05b.json]       # no --out: the table only

MODEL_DIR: e.g. the 0.5B shape from scripts/make_bench_model.py (random weights: drafts are almost never accepted,
so this measures the cost side; a trained I-DLM model brings the acceptance).

--agree: the other side, every draft accepted. The same checkpoint with its final norm's weight set to zero (a copy
in --agree-dir; every other byte unchanged), so that every position's logits are all zero and every prediction is
token 0: the verifier agrees with every draft, and ISD writes its most tokens per forward at the same cost per
forward. An upper bound of what ISD can gain over AR at each stride on this machine, not a model's quality.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import time

import mbd_rs

CONFIGS = {"bf16": {}, "f32": {"dtype": "f32"}, "q8_0": {"quantize": "q8_0"},
           "q8_0+int8": {"quantize": "q8_0", "int8_activations": True}}


def isa():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else platform.machine()


def agreeing_copy(src, dst):
    """`src` with model.norm.weight zeroed in its safetensors file (header read, the tensor's bytes overwritten)."""
    os.makedirs(dst, exist_ok=True)
    zeroed = False
    for name in os.listdir(src):
        if os.path.isdir(os.path.join(src, name)):
            continue
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(dst, name), "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            t = json.loads(f.read(n)).get("model.norm.weight")
            if t is not None:
                lo, hi = t["data_offsets"]
                f.seek(8 + n + lo)
                f.write(bytes(hi - lo))
                zeroed = True
    if not zeroed:
        raise SystemExit(f"{src}: no model.norm.weight in its safetensors files")
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--strides", default="2,4,8")
    ap.add_argument("--configs", default="bf16,q8_0+int8")
    ap.add_argument("--mask-token-id", type=int, default=151665)
    ap.add_argument("--out", default=None)
    ap.add_argument("--agree", action="store_true", help="every draft accepted (a copy with a zeroed final norm)")
    ap.add_argument("--agree-dir", default="/tmp/mbd-bench/isd-agree")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (benches/gpu/run.sh isd)")
    a = ap.parse_args()
    if a.agree:
        a.model = agreeing_copy(a.model, a.agree_dir)
    vocab = json.load(open(os.path.join(a.model, "config.json")))["vocab_size"]
    prompt = [(i * 7919) % min(150000, vocab - 200) + 100 for i in range(32)]
    modes = [("AR", {})] + [(f"ISD N={n}", {"speculative": "isd", "isd_stride": int(n)}) for n in a.strides.split(",")]
    results = {"agree": a.agree, "cpu": isa(), "cores": os.cpu_count(), "model": os.path.basename(a.model.rstrip("/")),
               "device": a.device, "prompt_tokens": len(prompt), "max_tokens": a.tokens, "rounds": a.rounds,
               "configs": {}}
    for cfg in a.configs.split(","):
        # (--agree: every prediction is token 0, which must not end the text)
        eos = dict(eos_token_ids=[1]) if a.agree else {}
        eng = mbd_rs.Engine.load(a.model, device=a.device, attention="causal", logits_shift=True,
                                 mask_token_id=a.mask_token_id, **eos, **CONFIGS[cfg])
        times = {m: [] for m, _ in modes}
        usage = {}
        for m, kw in modes:  # warm-up, and the deterministic usage (greedy)
            usage[m] = eng.generate(prompt, max_tokens=a.tokens, early_stop=False, **kw)
        for _ in range(a.rounds):
            for m, kw in modes:
                t = time.perf_counter()
                eng.generate(prompt, max_tokens=a.tokens, early_stop=False, **kw)
                times[m].append(time.perf_counter() - t)
        ar_ms = statistics.median(times["AR"]) * 1e3 / usage["AR"].usage.forward_passes
        rows = {}
        for m, _ in modes:
            c = usage[m]
            med = statistics.median(times[m])
            fwd = c.usage.forward_passes
            ms = med * 1e3 / fwd
            rows[m] = {"median_s": med, "tokens": len(c.token_ids), "forwards": fwd,
                       "tokens_per_forward": len(c.token_ids) / fwd, "ms_per_forward": ms,
                       "tokens_per_s": len(c.token_ids) / med, "drafts_proposed": c.usage.drafts_proposed,
                       "drafts_accepted": c.usage.drafts_accepted, "break_even_tokens_per_forward": ms / ar_ms,
                       "same_tokens_as_ar": c.token_ids == usage["AR"].token_ids, "times_s": times[m]}
        results["configs"][cfg] = rows
        where = eng.info.device if a.device != "cpu" else f"{isa()}, {os.cpu_count()} cores"
        results["where"] = where
        print(f"== {cfg} ({where}): median of {a.rounds} interleaved rounds")
        print(f"{'mode':10} {'tok/s':>7} {'tok/fwd':>8} {'ms/fwd':>7} {'x AR time':>9} {'break-even tok/fwd':>19} = AR")
        for m, r in rows.items():
            print(f"{m:10} {r['tokens_per_s']:7.1f} {r['tokens_per_forward']:8.2f} {r['ms_per_forward']:7.1f} "
                  f"{r['median_s'] / rows['AR']['median_s']:9.2f} {r['break_even_tokens_per_forward']:19.2f} "
                  f"{r['same_tokens_as_ar']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
