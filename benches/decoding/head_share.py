"""The head's share of a decode step: what a step costs beyond its forward's layers, the vocabulary product and the
per-row statistics over a real-sized vocabulary (151936), for two steps that predict many rows:

- "dream": a Dream-style full-canvas step (full attention, shifted logits, cache='none', one block as long as the
  canvas): every step forwards the prompt and the whole canvas and predicts every masked position of it;
- "window": a block-causal W-row window over a cached prompt (blocks of W, the 0.5B shape's own config), each step
  predicting the window's masked rows.

For each: the step's time (decode time / forward passes, the prompt's prefill taken out where there is one), the
forward of the same rows alone (`bench_forward`: the same window over the same cache, logits for every row), the
step / forward ratio, and `usage.head_ms` per step where the build reports it (the vocabulary product plus the
statistics, summed over steps). With `--old`/`--new` two builds (two Python interpreters, each with its own mbd_rs)
alternate in fresh processes round after round, the first of each pair switching every round, and the medians and
new/old ratios are printed; with neither, this interpreter's build alone.

    python scripts/make_bench_model.py /tmp/mbd-bench/qwen2.5-0.5b-shape
    python benches/decoding/head_share.py [--model /tmp/mbd-bench/qwen2.5-0.5b-shape] [--old PY --new PY]
        [--canvas 512] [--window 32] [--steps 3] [--reps 2] [--rounds 3] [--out FILE]
Writes head_share.json in benches/results/decoding/ (or --out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys
import mbd_rs
model, canvas, window, steps, prompt_len, reps = json.loads(sys.argv[1])
out = {}
def step_ms(eng, prompt, **kw):
    eng.generate(prompt, **dict(kw, max_forward_passes=1))  # warm
    u = eng.generate(prompt, **dict(kw, max_forward_passes=steps)).usage
    return (u.decode_ms - u.prefill_ms) / u.forward_passes, getattr(u, "head_ms", None), u.forward_passes
def fwd_ms(eng, p, w):
    return min(eng._core.bench_forward(p, w, reps + 1)[1:]) * 1e3
# a Dream-style full-canvas step: the prompt and the canvas forwarded whole, every masked position predicted
eng = mbd_rs.Engine.load(model, eos_token_ids=[], attention="full", logits_shift=True)
v = eng.info.vocab_size
prompt = [(17 * i + 5) % v for i in range(prompt_len)]
ms, head, n = step_ms(eng, prompt, max_tokens=canvas, block_size=canvas, cache="none", threshold=0.99)
out["dream step (ms)"] = ms
out["dream forward (ms)"] = fwd_ms(eng, 0, prompt_len + canvas)
if head is not None:
    out["dream head per step (ms)"] = head / n
del eng
# a block-causal window of `window` rows over the cached prompt
eng = mbd_rs.Engine.load(model, eos_token_ids=[])
ms, head, n = step_ms(eng, prompt, max_tokens=4 * window, block_size=window, threshold=0.99)
out[f"window W={window} step (ms)"] = ms
out[f"window W={window} forward (ms)"] = fwd_ms(eng, prompt_len, window)
if head is not None:
    out[f"window W={window} head per step (ms)"] = head / n
print(json.dumps(out))
"""


def ratios(r):
    """step / forward per case, added to a run's numbers."""
    for case in ("dream", [k[:-len(" step (ms)")] for k in r if k.startswith("window") and k.endswith("step (ms)")][0]):
        r[f"{case} step / forward"] = r[f"{case} step (ms)"] / r[f"{case} forward (ms)"]
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
    ap.add_argument("--old", default=None, help="an interpreter with the old build's mbd_rs")
    ap.add_argument("--new", default=None, help="an interpreter with the new build's mbd_rs")
    ap.add_argument("--canvas", type=int, default=512)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="forward passes per measured generation")
    ap.add_argument("--reps", type=int, default=2, help="forwards timed alone per case (the fastest kept)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "decoding", "head_share.json"))
    a = ap.parse_args()
    arg = json.dumps([a.model, a.canvas, a.window, a.steps, a.prompt_len, a.reps])
    builds = {"old": a.old, "new": a.new} if a.old and a.new else {"this": sys.executable}
    names = list(builds)
    runs = {k: [] for k in names}
    for r in range(a.rounds):
        for which in (names if r % 2 == 0 else names[::-1]):
            child = subprocess.run([builds[which], "-c", CHILD, arg], capture_output=True, text=True)
            if child.returncode:
                sys.exit(child.stderr)
            runs[which].append(ratios(json.loads(child.stdout.strip().splitlines()[-1])))
            print(which, json.dumps(runs[which][-1]), flush=True)
    keys = [k for k in runs[names[-1]][0]]
    head = f"{'measure':<36}" + "".join(f"{n:>10}" for n in names) + (f"{'new/old':>9}" if len(names) == 2 else "")
    print(head + f"   (medians of {a.rounds} runs" + (", alternating)" if len(names) == 2 else ")"))
    for k in keys:
        med = [statistics.median(r[k] for r in runs[n]) if k in runs[n][0] else None for n in names]
        row = f"{k:<36}" + "".join(f"{m:>10.2f}" if m is not None else f"{'-':>10}" for m in med)
        if len(names) == 2 and None not in med:
            row += f"{med[1] / med[0]:>9.3f}"
        print(row)
    json.dump(dict(model=a.model, canvas=a.canvas, window=a.window, prompt_len=a.prompt_len, steps=a.steps,
                   rounds=a.rounds, runs=runs), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
