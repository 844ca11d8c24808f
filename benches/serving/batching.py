"""Continuous batching: aggregate throughput and per-stream latency of N concurrent streams of one engine (batched
by its scheduler) against the same N requests run one after another, interleaved in one process.

For each model, decoding mode and N: the N requests (different prompts) run sequentially, then concurrently (N
threads started together), `--rounds` times alternating; medians are reported. Aggregate tokens/s = completion
tokens / wall time; ITL (inter-token latency) = a stream's time from its first token to its end / its further
tokens, TTFT = time to its first token (ms, means over streams). Outputs are checked equal between the two runs
(batching never changes them).

On a CPU a forward of R rows costs about a + b*R (the weights streamed once, then arithmetic per row): --fit
measures a and b with Model.bench_forward (least squares over 1 to 64 rows, the decode regime) and reports, for
every batched run, the time that line gives for the forwards it ran (count F and rows summed, from
Engine.batch_stats) against the measured wall time: "of limit" = (F*a + b*rows) / wall, the share of the
achievable throughput the scheduler reaches.

    python benches/serving/batching.py --model tiny --streams 1,2,4,8,16
    python benches/serving/batching.py --model /tmp/mbd-bench/qwen2.5-0.5b-shape-bf16 --fit --max-tokens 16
Writes batching.json in benches/results/batching-serving/ (--out).
"""
import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import mbd_rs

# this harness's results: benches/results/batching-serving/
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "batching-serving")

MODES = {
    # autoregressive: one-row windows (block size 1)
    "ar": dict(block_size=1),
    # multi-block decoding with a fixed threshold (random weights rarely pass it: forced progress then decodes,
    # so windows span the created blocks as in real runs)
    "mb": dict(block_size=4, threshold=0.9, acceptance="confidence", block_add_threshold=0.25,
               decoded_token_threshold=0.5),
}


def prompts(eng, n, length, seed):
    rnd = random.Random(seed)
    if eng.info.path.endswith("mbd-tiny"):
        base = ["Q: 2+3=", "Q: what is 17+25?", "hello Ada", "Q: 9*9=", "sort 3 1 2", "reverse x y z", "add 12+30",
                "repeat ab 3", "count a in abcab", "sort 9 8 7 1", "reverse q w e r", "Q: 50-8=", "hello Grace",
                "add 7+8", "repeat xy 2", "sort 5 4"]
        return [eng.tokenize(base[i % len(base)] + " " * (i // len(base))) for i in range(n)]
    v = eng.info.vocab_size
    return [[rnd.randrange(10, v - 10) for _ in range(length + (i % 5))] for i in range(n)]


def run_one(eng, prompt, kw, t0, rec, i):
    t_start = time.perf_counter()
    first = None
    tokens = []
    for ch in eng.stream(prompt, **kw):
        if ch.token_ids and first is None:
            first = time.perf_counter()
        tokens += ch.token_ids
    t_end = time.perf_counter()
    # inter-token latency: after the first token, the stream's time per further token
    itl = (t_end - first) / (len(tokens) - 1) if first is not None and len(tokens) > 1 else float("nan")
    rec[i] = dict(tokens=tokens, start=t_start - t0, end=t_end - t0, ttft=(first or t_end) - t_start, itl=itl)


def sequential(eng, ps, kw):
    rec = [None] * len(ps)
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        run_one(eng, p, kw, t0, rec, i)
    return time.perf_counter() - t0, rec


def concurrent(eng, ps, kw):
    rec = [None] * len(ps)
    gate = threading.Barrier(len(ps) + 1)

    def work(i):
        gate.wait()
        run_one(eng, ps[i], kw, t0, rec, i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(ps))]
    [t.start() for t in ts]
    t0 = time.perf_counter()
    gate.wait()
    [t.join() for t in ts]
    return time.perf_counter() - t0, rec


def fit_line(eng, prefix, rows=(1, 2, 4, 8, 16, 32, 64), reps=4):
    """Least-squares a + b*R over median forward times (seconds) at these row counts."""
    xs, ys = [], []
    for r in rows:
        t = sorted(eng._core.bench_forward(prefix, r, reps + 1)[1:])
        xs.append(r)
        ys.append(t[len(t) // 2])
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, list(zip(xs, ys))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--modes", default="ar,mb")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=4, help="random models: prompt tokens (short: decode dominates)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "batching.json"))
    a = ap.parse_args()
    # no EOS: every request decodes exactly max_tokens (comparable across N and runs)
    # prefix_cache=0: the sequential and concurrent runs repeat the prompts, and this measures batching alone
    eng = mbd_rs.Engine.load(None if a.model == "tiny" else a.model, eos_token_ids=[], prefix_cache=0)
    eng.set_batching(max_batch=64, max_batch_rows=4096)
    print(f"model {eng.info.path}: {eng.info.num_parameters / 1e6:.1f}M params, {eng.info.weight_bytes / 2**20:.0f} MiB "
          f"held, {mbd_rs._core.cpu_threads} threads", flush=True)
    line = None
    if a.fit:
        fa, fb, pts = fit_line(eng, a.prompt_len)
        line = (fa, fb)
        print(f"forward fit: a = {fa * 1e3:.1f} ms, b = {fb * 1e3:.2f} ms/row "
              f"(points: {', '.join(f'{r}:{t * 1e3:.0f}' for r, t in pts)})", flush=True)
    results = []
    hdr = (f"{'mode':>4} {'N':>3} {'seq tok/s':>10} {'batched tok/s':>13} {'ratio':>6} {'alone ITL':>9} "
           f"{'batched ITL':>11} {'ITL x':>6} {'alone TTFT':>10} {'batched TTFT':>12} {'steps/fwd':>9}"
           + (f" {'of limit':>8}" if line else ""))
    print(hdr, flush=True)
    for mode in a.modes.split(","):
        kw = dict(MODES[mode], max_tokens=a.max_tokens, early_stop=False)
        for n in [int(x) for x in a.streams.split(",")]:
            ps = prompts(eng, n, a.prompt_len, seed=n)
            eng.generate(ps[0], **kw)  # warm-up
            seq_w, con_w, seq_lat, con_lat, limit, spf, seq_ttft, con_ttft = [], [], [], [], [], [], [], []
            tokens = None
            for _ in range(a.rounds):
                w, rec = sequential(eng, ps, kw)
                seq_w.append(w)
                seq_lat.append(statistics.mean(r["itl"] for r in rec))
                seq_ttft.append(statistics.mean(r["ttft"] for r in rec))
                want = [r["tokens"] for r in rec]
                f0, s0, r0 = eng.batch_stats
                w, rec2 = concurrent(eng, ps, kw)
                f1, s1, r1 = eng.batch_stats
                con_w.append(w)
                con_lat.append(statistics.mean(r["itl"] for r in rec2))
                con_ttft.append(statistics.mean(r["ttft"] for r in rec2))
                assert [r["tokens"] for r in rec2] == want, "batched outputs differ from sequential ones"
                spf.append((s1 - s0) / max(1, f1 - f0))
                if line:
                    limit.append((line[0] * (f1 - f0) + line[1] * (r1 - r0)) / w)
                tokens = sum(len(t) for t in want)
            sw, cw = statistics.median(seq_w), statistics.median(con_w)
            sl, cl = statistics.median(seq_lat), statistics.median(con_lat)
            r = dict(mode=mode, streams=n, tokens=tokens, seq_tok_s=tokens / sw, batched_tok_s=tokens / cw,
                     ratio=sw / cw, alone_itl_ms=sl * 1e3, batched_itl_ms=cl * 1e3, latency_ratio=cl / sl,
                     alone_ttft_ms=statistics.median(seq_ttft) * 1e3, batched_ttft_ms=statistics.median(con_ttft) * 1e3,
                     steps_per_forward=statistics.median(spf), of_limit=statistics.median(limit) if limit else None)
            results.append(r)
            print(f"{mode:>4} {n:>3} {r['seq_tok_s']:>10.1f} {r['batched_tok_s']:>13.1f} {r['ratio']:>6.2f} "
                  f"{r['alone_itl_ms']:>9.2f} {r['batched_itl_ms']:>11.2f} {r['latency_ratio']:>6.2f} "
                  f"{r['alone_ttft_ms']:>10.1f} {r['batched_ttft_ms']:>12.1f} "
                  f"{r['steps_per_forward']:>9.2f}" + (f" {r['of_limit']:>8.2f}" if line else ""), flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(model=eng.info.path, threads=mbd_rs._core.cpu_threads, fit=line, max_tokens=a.max_tokens,
                       results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
