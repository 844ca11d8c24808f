"""Single-stream speed of two builds of mbd-rs, side by side: each build is a Python interpreter with its own
mbd_rs installed (e.g. two venvs with release wheels of two commits); measurements alternate between them in
fresh child processes, `--rounds` times, the first of each pair switching every round (the second process of a
pair can run slower on these machines: always starting one build first once showed a 3-16% "regression" that was
the order), and the medians and new/old ratios are printed.

Measures one forward (Model.bench_forward: a W-row window over a P-token cache, logits for every row) and end to
end single-stream generation (tokens/s of generate, one request at a time).

    python benches/forward/single_stream_ab.py --old /tmp/venv-old/bin/python --new /tmp/venv-new/bin/python \
        [--model DIR] [--cases 0:1,16:4,64:8] [--rounds 4] [--no-e2e] [--out FILE]
"""
import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import mbd_rs
model, cases, gen = json.loads(sys.argv[1])
eng = mbd_rs.Engine.load(model, eos_token_ids=[])
out = {}
for p, w, reps in cases:
    t = sorted(eng._core.bench_forward(p, w, reps + 1)[1:])
    out[f"forward P={p} W={w} (ms)"] = t[len(t) // 2] * 1e3
v = eng.info.vocab_size
prompt = eng.tokenize("sort 5 3 8 1 9 2") if v < 1000 else [(17 * i + 5) % v for i in range(24)]
for name, kw in gen:
    eng.generate(prompt, **dict(kw, max_tokens=8))
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < 1.5 or n < 2:
        c = eng.generate(prompt, **kw); n += 1
    out[name + " (tokens/s)"] = n * len(c.token_ids) / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--cases", default="0:1,16:4,64:8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-e2e", action="store_true", help="forwards only (no generation)")
    ap.add_argument("--out", default=None, help="write every run's numbers here (JSON)")
    a = ap.parse_args()
    cases = [[int(x) for x in c.split(":")] + [a.reps] for c in a.cases.split(",")]
    gen = [] if a.no_e2e else [
        ["generate multi-block B=4", dict(max_tokens=a.max_tokens, block_size=4, threshold=0.9)],
        ["generate AR", dict(max_tokens=a.max_tokens, block_size=1)]]
    arg = json.dumps([a.model, cases, gen])
    runs = {"old": [], "new": []}
    for r in range(a.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            py = a.old if which == "old" else a.new
            child = subprocess.run([py, "-c", CHILD, arg], capture_output=True, text=True, check=True)
            runs[which].append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"{'measure':<34} {'old':>10} {'new':>10} {'new/old':>8}   (medians of {a.rounds} alternating runs)")
    for k in runs["old"][0]:
        o = statistics.median(r[k] for r in runs["old"])
        n = statistics.median(r[k] for r in runs["new"])
        print(f"{k:<34} {o:>10.2f} {n:>10.2f} {n / o:>8.2f}")
    sys.stdout.flush()
    if a.out:
        json.dump(dict(model=a.model, cases=a.cases, rounds=a.rounds, reps=a.reps, runs=runs), open(a.out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
