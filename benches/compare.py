"""End to end, side by side in one process, on the same model and prompts: mbd-rs multi-block, mbd-rs AR
(block_size 1), the PyTorch reference decoder (tests/reference/decoder.py: whole-sequence recompute, as the
authors' code does) with the same decoding parameters, and transformers' generate (AR with its KV cache, greedy).
Prints one table (tokens/s, forward passes, tokens per forward, ms per forward, peak RSS during the run, whether
outputs match the reference decoder) and writes benches/compare.json.

    python benches/compare.py [--model DIR] [--prompts 12] [--max-tokens 40]
Needs torch + transformers next to mbd_rs (developer tools).
"""
import argparse
import json
import os
import random
import sys
import threading
import time

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "training"))
import mbd_rs  # noqa: E402
from reference.decoder import completion_tokens, reference_decode  # noqa: E402
from tasks import TASKS, sample  # noqa: E402


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRss:
    def __enter__(self):
        self.peak, self.stop = rss_mb(), False
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()
        return self

    def loop(self):
        while not self.stop:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.005)

    def __exit__(self, *a):
        self.stop = True
        self.t.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    eng = mbd_rs.Engine.load(args.model, device="cpu")
    info = eng.info
    r = random.Random(99)
    prompts = [eng.tokenize(eng.apply_chat_template([{"role": "user", "content": sample(r, True, t)[1]}]), add_special_tokens=False)
               for t in list(TASKS) * (args.prompts // len(TASKS) + 1)][: args.prompts]
    hf = transformers.AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32, attn_implementation="eager").eval()
    eos = info.eos_token_ids
    multi = dict(block_size=info.block_size, threshold=0.5, acceptance="entropy", block_add_threshold=0.1,
                 decoded_token_threshold=0.95, forced_progress="first", early_stop=True)
    ref_kw = dict(mask_id=info.mask_token_id, block_size=multi["block_size"], attention=info.attention, alignment=info.alignment,
                  logits_shift=info.logits_shift, threshold=multi["threshold"], acceptance="entropy", alpha=0.1, beta=0.95,
                  forced="first", early_stop=True, eos_ids=eos)

    def run_mbd(**kw):
        outs, fwd = [], 0
        for p in prompts:
            c = eng.generate(p, max_tokens=args.max_tokens, **kw)
            outs.append(c.token_ids)
            fwd += c.usage.forward_passes
        return outs, fwd

    def run_ref():
        outs, fwd = [], 0
        for p in prompts:
            gen, nfe = reference_decode(hf, p, n=args.max_tokens, **ref_kw)
            outs.append(completion_tokens(gen, eos))
            fwd += nfe
        return outs, fwd

    def run_hf_generate():
        outs, fwd = [], 0
        for p in prompts:
            with torch.no_grad():
                o = hf.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[-1])
            new = o[0, len(p):].tolist()
            outs.append(completion_tokens(new, eos))
            fwd += len(new)
        return outs, fwd

    methods = [("mbd-rs multi-block", lambda: run_mbd(**multi)),
               ("mbd-rs AR (block 1)", lambda: run_mbd(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0)),
               ("PyTorch reference decoder", run_ref),
               ("transformers generate (AR, KV cache)", run_hf_generate)]
    run_mbd(**multi)  # warm-up
    results, ref_out = [], None
    for name, fn in methods:
        with PeakRss() as m:
            t = time.perf_counter()
            outs, fwd = fn()
            dt = time.perf_counter() - t
        toks = sum(len(o) for o in outs)
        results.append(dict(method=name, tokens=toks, seconds=dt, tokens_per_second=toks / dt, forward_passes=fwd,
                            tokens_per_forward=toks / fwd, ms_per_forward=1e3 * dt / fwd, peak_rss_mb=m.peak, outputs=outs))
        if name.startswith("PyTorch reference"):
            ref_out = outs
    for row in results:
        row["matches_reference"] = row["outputs"] == ref_out
    base = next(r for r in results if r["method"].startswith("PyTorch reference"))
    print(f"model {info.path} ({info.num_parameters / 1e6:.2f}M params), {len(prompts)} prompts, max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} threads")
    print(f"{'method':38s} {'tok/s':>9s} {'x ref':>6s} {'forwards':>8s} {'tok/fwd':>7s} {'ms/fwd':>7s} {'peak RSS MB':>11s} {'= ref':>5s}")
    for row in results:
        print(f"{row['method']:38s} {row['tokens_per_second']:9.1f} {row['tokens_per_second'] / base['tokens_per_second']:6.2f} "
              f"{row['forward_passes']:8d} {row['tokens_per_forward']:7.2f} {row['ms_per_forward']:7.2f} {row['peak_rss_mb']:11.0f} "
              f"{'yes' if row['matches_reference'] else 'no':>5s}")
    for row in results:
        row.pop("outputs")
    json.dump(dict(model=info.path, prompts=len(prompts), max_tokens=args.max_tokens, results=results),
              open(os.path.join(ROOT, "benches", "compare.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
