"""CUDA graphs of the decode forward (`_kernels=dict(cuda_segments=True, cuda_graphs=True)`, off by default until a
GPU run proves them): run on a machine with an NVIDIA GPU by `bash benches/gpu/run.sh graphs` (run.sh says what to
build and copy there first), or anywhere with --device cpu as a dry run of the script (there no graph is made, and
the check that graphs were replayed is skipped).

The checkpoint and the streams are segments.py's (the SDAR-1.7B attention shape in 2 layers, a 4096-token
vocabulary so that greedy tokens follow the last bit of the logits; K streams of different prompt lengths, block
sizes and decoding modes). Each stream decodes
  1. alone without graphs (cuda_segments on: the launches a graph captures);
  2. alone with graphs (each forward shape run once, captured on its second forward, checked bit for bit against a
     forward without the graph on its first replay, replayed after);
  3. batched (continuous batching, threads) with graphs, over --rounds rounds.
Every stream's tokens and forward count must be the same in all three, and graphs must have been replayed with
none refused (`Engine.graph_stats`). Then tokens/s with graphs off and on, interleaved: one stream multi-block, one
stream AR (block size 1), and the K streams batched. Writes one JSON (--out); exits non-zero on a difference.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from segments import finish, run, setup  # noqa: E402


def main():
    t0 = time.time()
    args, off, on, reqs = setup("graphs", dict(cuda_segments=True), dict(cuda_segments=True, cuda_graphs=True))
    failures = []

    def compare(label, got, want):
        for i, (g, a) in enumerate(zip(got, want)):
            if g != a:
                failures.append(f"{label}: stream {i} ({reqs[i][1]}) {g[0][:8]}... in {g[1]} forwards "
                                f"!= without graphs {a[0][:8]}... in {a[1]}")

    alone = run(off, reqs, together=False)
    compare("graphs alone", run(on, reqs, together=False), alone)
    stats_alone = on.graph_stats
    print("alone: graph_stats (captured, replayed, refused) =", stats_alone, flush=True)
    report = {"device": on.info.device, "streams": args.streams, "graph_stats_alone": stats_alone, "rounds": []}
    prompt, kw = reqs[0][0], dict(max_tokens=64, temperature=0.0, early_stop=False)
    for r in range(args.rounds):
        row = {}
        for name, eng in (("off", off), ("on", on)):
            for label, extra in (("multi-block", dict(block_size=4)), ("ar", dict(block_size=1))):
                c = eng.generate(prompt, **kw, **extra)
                row[f"{name}_{label}_tokens_per_s"] = round(c.usage.tokens_per_second, 1)
            t = time.perf_counter()
            got = run(eng, reqs, together=True)
            wall = time.perf_counter() - t
            compare(f"round {r} batched, graphs {name}", got, alone)
            row[f"{name}_streams_tokens_per_s"] = round(sum(len(g[0]) for g in got) / wall, 1)
        for k in ("multi-block_tokens_per_s", "ar_tokens_per_s", "streams_tokens_per_s"):
            row[f"on_vs_off_{k}"] = round(row[f"on_{k}"] / row[f"off_{k}"], 3)
        report["rounds"].append(row)
        print(f"round {r}: {row}", flush=True)
    captured, replayed, refused = report["graph_stats"] = on.graph_stats
    print("graph_stats (captured, replayed, refused) =", report["graph_stats"], flush=True)
    if args.device != "cpu" and (replayed == 0 or refused > 0):
        failures.append(f"graphs: {captured} captured, {replayed} replayed, {refused} shapes refused")
    finish("graphs", report, failures, t0, args.out)


if __name__ == "__main__":
    main()
