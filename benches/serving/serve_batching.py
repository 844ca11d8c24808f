"""Batching through the server: N streaming clients (the official `openai` client, one thread each) against the
same N requests one after another, on an in-process `mbd-rs serve` app (uvicorn on a local port). Reports
aggregate completion tokens/s, per-stream ms per token and time to first content, and checks that the texts are
the same both ways.

    python benches/serving/serve_batching.py [--model DIR] [--clients 8,32] [--max-tokens 32] [--rounds 2]
Needs the [server] extra and openai. Writes
benches/results/batching-serving/serve_batching.json (--out).
"""
import argparse
import json
import os
import statistics
import threading
import time

import openai
import uvicorn

import mbd_rs
from mbd_rs.server import create_app
from serving import free_port

# this harness's results: benches/results/batching-serving/
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "batching-serving")

TASKS = ["sort 3 1 2", "reverse x y z", "add 12+30", "repeat ab 3", "count a in abcab", "hello Ada", "sort 9 8 7 1",
         "reverse q w e r", "hello Grace", "repeat xy 2", "sort 5 4", "add 7+8"]


def one(client, i, max_tokens, t0, rec):
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    stream = client.chat.completions.create(model="m", stream=True, max_tokens=max_tokens,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": TASKS[i % len(TASKS)] + " " * (i // 12)}])
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
    end = time.perf_counter()
    rec[i] = dict(text="".join(text), tokens=tokens, ttft=(first or end) - start, dur=end - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", default="8,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "serve_batching.json"))
    a = ap.parse_args()
    eng = mbd_rs.Engine.load(a.model, eos_token_ids=[], prefix_cache=0)  # fixed-length answers; batching alone
    ns = [int(x) for x in a.clients.split(",")]
    port = free_port()
    app = create_app(eng, model_name="m", max_concurrency=max(ns), max_queue=0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    print(f"model {eng.info.path}, {mbd_rs._core.cpu_threads} threads, max_tokens {a.max_tokens}", flush=True)
    print(f"{'clients':>7} {'seq tok/s':>10} {'batched tok/s':>13} {'ratio':>6} {'alone ms/tok':>12} "
          f"{'batched ms/tok':>14} {'alone ttft ms':>13} {'batched ttft ms':>15}", flush=True)
    results = []
    for n in ns:
        one(client, 0, a.max_tokens, 0, [None])  # warm-up
        sw, cw, sl, cl, st, ct = [], [], [], [], [], []
        for _ in range(a.rounds):
            rec = [None] * n
            t0 = time.perf_counter()
            for i in range(n):
                one(client, i, a.max_tokens, t0, rec)
            sw.append(time.perf_counter() - t0)
            want = [r["text"] for r in rec]
            tokens = sum(r["tokens"] for r in rec)
            sl.append(statistics.mean(r["dur"] / max(1, r["tokens"]) for r in rec))
            st.append(statistics.mean(r["ttft"] for r in rec))
            rec = [None] * n
            ts = [threading.Thread(target=one, args=(client, i, a.max_tokens, 0, rec)) for i in range(n)]
            t0 = time.perf_counter()
            [t.start() for t in ts]
            [t.join() for t in ts]
            cw.append(time.perf_counter() - t0)
            assert [r["text"] for r in rec] == want, "batched texts differ"
            cl.append(statistics.mean(r["dur"] / max(1, r["tokens"]) for r in rec))
            ct.append(statistics.mean(r["ttft"] for r in rec))
        m = statistics.median
        r = dict(clients=n, tokens=tokens, seq_tok_s=tokens / m(sw), batched_tok_s=tokens / m(cw), ratio=m(sw) / m(cw),
                 alone_ms_per_token=m(sl) * 1e3, batched_ms_per_token=m(cl) * 1e3, alone_ttft_ms=m(st) * 1e3,
                 batched_ttft_ms=m(ct) * 1e3)
        results.append(r)
        print(f"{n:>7} {r['seq_tok_s']:>10.1f} {r['batched_tok_s']:>13.1f} {r['ratio']:>6.2f} "
              f"{r['alone_ms_per_token']:>12.2f} {r['batched_ms_per_token']:>14.2f} {r['alone_ttft_ms']:>13.1f} "
              f"{r['batched_ttft_ms']:>15.1f}", flush=True)
    server.should_exit = True
    with open(a.out, "w") as f:
        json.dump(dict(model=eng.info.path, max_tokens=a.max_tokens, results=results), f, indent=1)


if __name__ == "__main__":
    main()
