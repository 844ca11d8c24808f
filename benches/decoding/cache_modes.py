"""Time per decode step of the full-attention (approximate) cache modes, side by side in one process, interleaved.

Loads a checkpoint as a Dream-style model (full attention, shifted logits) and decodes a long random prompt with
each mode in turn, round after round: cache='none' (the whole canvas every step) and cache='prefix' with several
delays and refresh intervals. Reports ms per step (decode time / forward passes, the first step's prompt pass
included), positions forwarded per step and the ratio to 'none' from the same round.

    python benches/decoding/cache_modes.py [--model /tmp/mbd-bench/qwen2.5-0.5b-shape-bf16] [--prompt-len 1024]
        [--max-tokens 64] [--steps 12] [--rounds 2]
Writes cache_modes.json (with --modes: cache_modes_<modes>.json) in benches/results/decoding/.
"""
import argparse
import json
import os
import random
import statistics

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = [
    ("none", dict(cache="none")),
    ("prefix delay 1", dict(cache="prefix", cache_delay=1)),
    ("prefix delay 2", dict(cache="prefix", cache_delay=2)),
    ("prefix delay 4", dict(cache="prefix", cache_delay=4)),
    ("prefix delay 1, refresh 4", dict(cache="prefix", cache_delay=1, refresh_interval=4)),
    ("prefix delay 1 created", dict(cache="prefix", cache_delay=1, prefix_window="created")),
    ("dual", dict(cache="dual")),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape-bf16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="forward passes per run (max_forward_passes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=None, help="comma-separated subset of the mode names (none is always run)")
    args = ap.parse_args()
    modes = MODES if not args.modes else [m for m in MODES if m[0] == "none" or m[0] in args.modes.split(",")]
    eng = mbd_rs.Engine.load(args.model, device="cpu", attention="full", logits_shift=True,
                             mask_token_id=eng_mask(args.model), eos_token_ids=[])
    r = random.Random(0)
    prompt = [r.randrange(1000, 30000) for _ in range(args.prompt_len)]
    kw = dict(max_tokens=args.max_tokens, block_size=args.block_size, max_forward_passes=args.steps,
              early_stop=False)
    runs = {name: [] for name, _ in modes}
    for rnd in range(args.rounds):
        for name, mode in modes:
            c = eng.generate(prompt, **kw, **mode)
            u = c.usage
            runs[name].append(dict(ms_per_step=u.decode_ms / u.forward_passes, steps=u.forward_passes,
                                   positions_per_step=u.positions_forwarded / u.forward_passes,
                                   tokens=u.completion_tokens, token_ids=c.token_ids))
            print(f"round {rnd} {name:28s} {runs[name][-1]['ms_per_step']:9.1f} ms/step "
                  f"{runs[name][-1]['positions_per_step']:7.1f} positions/step", flush=True)
    rows = []
    for name, _ in modes:
        ratios = [n["ms_per_step"] / x["ms_per_step"] for n, x in zip(runs["none"], runs[name])]
        rows.append(dict(mode=name, ms_per_step=statistics.median(x["ms_per_step"] for x in runs[name]),
                         positions_per_step=runs[name][0]["positions_per_step"],
                         speedup_vs_none=statistics.median(ratios),
                         same_tokens_as_none=runs[name][0]["token_ids"] == runs["none"][0]["token_ids"]))
    print("\n| mode | ms/step | positions/step | speed-up vs none (same round) | tokens = none |")
    print("|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['mode']} | {x['ms_per_step']:.0f} | {x['positions_per_step']:.0f} | "
              f"{x['speedup_vs_none']:.2f}x | {x['same_tokens_as_none']} |")
    out = dict(model=args.model, prompt_len=args.prompt_len, max_tokens=args.max_tokens, block_size=args.block_size,
               steps=args.steps, rounds=args.rounds, rows=rows)
    stem = "cache_modes" if not args.modes else "cache_modes_" + args.modes.replace(",", "_").replace(" ", "")
    json.dump(out, open(os.path.join(ROOT, "benches", "results", "decoding", stem + ".json"), "w"), indent=1)


def eng_mask(model):
    """A mask id for a checkpoint that has none (random-weight shapes): the last vocabulary id."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    return cfg.get("mask_token_id") or cfg["vocab_size"] - 1


if __name__ == "__main__":
    main()
