"""End to end, side by side in one process, on the same model and prompts: mbd-rs multi-block, mbd-rs AR
(block_size 1), the PyTorch reference decoder (tests/reference/decoder.py: whole-sequence recompute, as the
authors' code does) with the same decoding parameters, and transformers' generate (AR with its KV cache, greedy).
Prints one table (tokens/s, forward passes, tokens per forward, ms per forward, peak RSS, whether outputs match
the reference decoder) and writes benches/results/cpu-forward/compare.json.

Timing: the mbd-rs rows are the median over --repeats rounds, the two mbd-rs methods alternating within each round
(the machine is shared and noisy); the PyTorch rows run once (they are 20-40x slower). Peak RSS: each method runs
once more in a fresh child process that imports only what it needs, so the numbers are per method (in the timing
process torch is loaded next to mbd-rs).

    python benches/decoding/compare.py [--model DIR] [--prompts 12] [--max-tokens 40] [--repeats 5]
Needs torch + transformers next to mbd_rs (developer tools).
"""
import argparse
import json
import os
import random
import sys
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "training"))
import mbd_rs  # noqa: E402
from reference.decoder import completion_tokens, reference_decode  # noqa: E402
from tasks import TASKS, sample  # noqa: E402


def peak_rss_mb():
    """This process's peak RSS (VmHWM: per address space, so not inherited from the parent across exec, unlike
    getrusage's ru_maxrss)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


METHODS = ["mbd-rs multi-block", "mbd-rs AR (block 1)", "PyTorch reference decoder", "transformers generate (AR, KV cache)"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", choices=range(len(METHODS)), type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is None or args.child >= 2:
        import torch
        import transformers
        torch.set_num_threads(os.cpu_count())
    eng = mbd_rs.Engine.load(args.model, device="cpu", prefix_cache=0)  # every method pays its own prefill
    info = eng.info
    r = random.Random(99)
    prompts = [eng.tokenize(eng.apply_chat_template([{"role": "user", "content": sample(r, True, t)[1]}]), add_special_tokens=False)
               for t in list(TASKS) * (args.prompts // len(TASKS) + 1)][: args.prompts]
    hf = None
    if args.child is None or args.child >= 2:
        hf = transformers.AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32, attn_implementation="eager").eval()
    eos = info.eos_token_ids
    multi = dict(block_size=info.block_size, threshold=0.5, acceptance="entropy", block_add_threshold=0.1,
                 decoded_token_threshold=0.95, forced_progress="first", early_stop=True)
    ref_kw = dict(mask_id=info.mask_token_id, block_size=multi["block_size"], attention=info.attention, alignment=info.alignment,
                  logits_shift=info.logits_shift, threshold=multi["threshold"], acceptance="entropy", alpha=0.1, beta=0.95,
                  forced="first", early_stop=True, eos_ids=eos)

    window, prefill = {}, {}

    def run_mbd(**kw):
        outs, fwd, pos, pre = [], 0, 0, 0.0
        for p in prompts:
            c = eng.generate(p, max_tokens=args.max_tokens, **kw)
            outs.append(c.token_ids)
            fwd += c.usage.forward_passes
            pos += c.usage.positions_forwarded
            pre += c.usage.prefill_ms / 1e3
        window[kw.get("block_size")] = pos / fwd  # mean positions per decode forward
        prefill.setdefault(kw.get("block_size"), []).append(pre)
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

    ar = dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0)
    fns = [lambda: run_mbd(**multi), lambda: run_mbd(**ar), run_ref, run_hf_generate]
    if args.child is not None:  # one method, once, in a fresh process: report its peak RSS
        outs, _ = fns[args.child]()
        print(json.dumps(dict(peak_rss_mb=peak_rss_mb(), tokens=sum(len(o) for o in outs))))
        return
    run_mbd(**multi), run_mbd(**ar)  # warm-up
    timings = {0: [], 1: []}
    outputs, forwards = {}, {}
    for rnd in range(args.repeats):
        for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            outputs[i], forwards[i] = fns[i]()
            timings[i].append(time.perf_counter() - t)
    for i in (2, 3):
        t = time.perf_counter()
        outputs[i], forwards[i] = fns[i]()
        timings[i] = [time.perf_counter() - t]
    rss = {}
    for i in range(len(METHODS)):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(i), "--prompts", str(args.prompts),
               "--max-tokens", str(args.max_tokens)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rss[i] = json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]
    results = []
    for i, name in enumerate(METHODS):
        dt = statistics.median(timings[i])
        toks = sum(len(o) for o in outputs[i])
        fwd = forwards[i]
        results.append(dict(method=name, tokens=toks, seconds=dt, runs=len(timings[i]), tokens_per_second=toks / dt,
                            forward_passes=fwd, tokens_per_forward=toks / fwd, ms_per_forward=1e3 * dt / fwd,
                            peak_rss_mb=rss[i], matches_reference=outputs[i] == outputs[2]))
    base = results[2]
    print(f"model {info.path} ({info.num_parameters / 1e6:.2f}M params), {len(prompts)} prompts, max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} threads, mbd-rs median of {args.repeats} runs")
    print(f"{'method':38s} {'tok/s':>9s} {'x ref':>6s} {'forwards':>8s} {'tok/fwd':>7s} {'ms/fwd':>7s} {'peak RSS MB':>11s} {'= ref':>5s}")
    for row in results:
        print(f"{row['method']:38s} {row['tokens_per_second']:9.1f} {row['tokens_per_second'] / base['tokens_per_second']:6.2f} "
              f"{row['forward_passes']:8d} {row['tokens_per_forward']:7.2f} {row['ms_per_forward']:7.2f} {row['peak_rss_mb']:11.0f} "
              f"{'yes' if row['matches_reference'] else 'no':>5s}")
    speedup = results[0]["tokens_per_second"] / results[1]["tokens_per_second"]
    # the same without the prompt prefill (identical work in both modes)
    dec = [results[i]["tokens"] / (results[i]["seconds"] - statistics.median(prefill[b]))
           for i, b in ((0, multi["block_size"]), (1, 1))]
    tpf_ratio = results[0]["tokens_per_forward"] / results[1]["tokens_per_forward"]
    print(f"multi-block over AR: speedup {speedup:.2f} for a tokens-per-forward ratio of {tpf_ratio:.2f} -> "
          f"{speedup / tpf_ratio:.2f} (target >= 0.8); mean window {window[multi['block_size']]:.1f} positions "
          f"(multi-block) vs {window[1]:.1f} (AR); without the prompt prefill: speedup {dec[0] / dec[1]:.2f} -> "
          f"{dec[0] / dec[1] / tpf_ratio:.2f}")
    json.dump(dict(model=info.path, prompts=len(prompts), max_tokens=args.max_tokens, repeats=args.repeats,
                   multi_over_ar=dict(speedup=speedup, tpf_ratio=tpf_ratio, ratio=speedup / tpf_ratio,
                                      mean_window_multi=window[multi["block_size"]], mean_window_ar=window[1],
                                      decode_only_speedup=dec[0] / dec[1]),
                   results=results),
              open(os.path.join(ROOT, "benches", "results", "cpu-forward", "compare.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
