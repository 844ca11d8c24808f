"""What a request that finds nothing in the prefix cache pays for it: cold requests (each prompt new) on two
installs of mbd-rs, e.g. the build before the cache and the build with it (on by default), in fresh processes
that alternate A B A B; each process loads the model and times `--requests` requests, the figure is the median
request's wall time, and the ratio is taken pair by pair.

    python benches/serving/cold_ab.py --a /tmp/venv-old/bin/python --b /tmp/venv-new/bin/python \\
        [--model /tmp/mbd-bench/qwen2.5-0.5b-shape] [--prompt 512] [--tokens 16] [--pairs 4]

`--model embedded`: the embedded mbd-tiny, chat requests of its tasks (sort, reverse, add with random operands,
`--tokens` at most) instead of random token prompts: the per-step work beside a forward of a few milliseconds shows
there. Those prompts share the chat template's first tokens, so they may hit a page of the prefix cache where the
install has one.

Prints the per-pair numbers and the median ratio B/A; writes nothing.
"""
import argparse
import json
import statistics
import subprocess

CHILD = r"""
import json, random, statistics, sys, time
import mbd_rs
model, n_prompt, n_tok, n_req, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
r = random.Random(seed)
if model == "embedded":
    eng = mbd_rs.Engine.load()
    def task():
        k = r.randrange(3)
        if k == 0:
            return "sort " + " ".join(str(r.randrange(10)) for _ in range(r.randrange(3, 8)))
        if k == 1:
            return "reverse " + " ".join(r.choice("abcdefgh") for _ in range(r.randrange(3, 8)))
        return f"add {r.randrange(100)}+{r.randrange(100)}"
    run = lambda: eng.chat([{"role": "user", "content": task()}], max_tokens=n_tok)
else:
    eng = mbd_rs.Engine.load(model, mask_token_id=0)
    V = eng.info.vocab_size
    run = lambda: eng.generate([r.randrange(10, V) for _ in range(n_prompt)], max_tokens=n_tok)
run()  # warm-up
times = []
for _ in range(n_req):
    t0 = time.perf_counter()
    c = run()
    times.append(time.perf_counter() - t0)
    assert model == "embedded" or getattr(c.usage, "cached_tokens", 0) == 0
print(json.dumps({"median_s": statistics.median(times), "times": times}))
"""

ap = argparse.ArgumentParser()
ap.add_argument("--a", required=True, help="the Python of install A (the baseline)")
ap.add_argument("--b", required=True, help="the Python of install B")
ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape", help="a model directory, or embedded")
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--requests", type=int, default=4)
ap.add_argument("--pairs", type=int, default=4)
args = ap.parse_args()


def run(py, seed):
    out = subprocess.run([py, "-c", CHILD, args.model, str(args.prompt), str(args.tokens), str(args.requests),
                          str(seed)], capture_output=True, text=True, check=True, cwd="/tmp")
    return json.loads(out.stdout.strip().splitlines()[-1])["median_s"]


ratios = []
for i in range(args.pairs):
    a, b = run(args.a, 100 + i), run(args.b, 100 + i)  # the same prompts on both
    ratios.append(b / a)
    print(f"pair {i}: A {a * 1e3:.0f} ms, B {b * 1e3:.0f} ms, B/A {b / a:.3f}", flush=True)
print(f"median B/A over {args.pairs} pairs: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
      f"max {max(ratios):.3f})")
