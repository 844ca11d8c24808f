"""Accuracy vs speed of the embedded mbd-tiny model on the held-out split of its task families.

Runs AR (block_size 1), single-block (alpha 1.0) and multi-block decoding (alpha 0.1, beta 0.95) at several
thresholds for both acceptance policies, on the same held-out instances, in one process. Prints a table,
writes benches/tiny_eval.json, and (with matplotlib installed) benches/tiny_accuracy_vs_tpf.png.

    python benches/eval_tiny.py [--per-task 40] [--model DIR]
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "training"))
from tasks import TASKS, held_out_set  # noqa: E402

import mbd_rs  # noqa: E402

CONFIGS = [("AR (block 1)", dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0))]
for tau in (0.9, 0.7):
    CONFIGS.append((f"single-block confidence {tau}", dict(block_size=4, block_add_threshold=1.0, acceptance="confidence", threshold=tau)))
for tau in (0.05, 0.2, 0.5, 1.0):
    CONFIGS.append((f"multi-block entropy {tau}", dict(block_size=4, acceptance="entropy", threshold=tau)))
for tau in (0.95, 0.9, 0.7, 0.5):
    CONFIGS.append((f"multi-block confidence {tau}", dict(block_size=4, acceptance="confidence", threshold=tau)))
for tau in (0.2, 0.5):
    CONFIGS.append((f"multi-block B8 entropy {tau}", dict(block_size=8, acceptance="entropy", threshold=tau)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-task", type=int, default=40)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    eng = mbd_rs.Engine.load(args.model, device="cpu")
    data = held_out_set(args.per_task)
    results = []
    for name, cfg in CONFIGS:
        correct, toks, fwd, secs = 0, 0, 0, 0.0
        per_task = {t: [0, 0] for t in TASKS}
        for task, p, a in data:
            t = time.perf_counter()
            c = eng.chat([{"role": "user", "content": p}], max_tokens=args.max_tokens, **cfg)
            secs += time.perf_counter() - t
            ok = c.text == a
            correct += ok
            per_task[task][0] += ok
            per_task[task][1] += 1
            toks += c.usage.completion_tokens
            fwd += c.usage.forward_passes
        row = dict(config=name, params=cfg, accuracy=correct / len(data), tokens_per_forward=toks / fwd,
                   tokens_per_second=toks / secs, per_task={k: v[0] / v[1] for k, v in per_task.items()})
        results.append(row)
        print(f"{name:32s} acc {row['accuracy'] * 100:5.1f}%  tpf {row['tokens_per_forward']:.2f}  "
              f"{row['tokens_per_second']:7.0f} tok/s  " + " ".join(f"{k}:{v * 100:.0f}" for k, v in row["per_task"].items()),
              flush=True)
    out = dict(model=eng.info.path, instances=len(data), max_tokens=args.max_tokens, results=results)
    json.dump(out, open(os.path.join(ROOT, "benches", "tiny_eval.json"), "w"), indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pick, mk in [("AR", "AR", "s"), ("single-block", "single", "^"), ("multi-block entropy", "multi-block entropy", "o"),
                            ("multi-block confidence", "multi-block confidence", "D"), ("multi-block B8", "B8", "x")]:
        pts = [r for r in results if pick in r["config"]]
        ax.plot([r["tokens_per_forward"] for r in pts], [100 * r["accuracy"] for r in pts], marker=mk, label=label)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("exact-match accuracy on held-out (%)")
    ax.set_title(f"mbd-tiny: accuracy vs parallelism ({len(data)} held-out instances)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benches", "tiny_accuracy_vs_tpf.png"), dpi=110)


if __name__ == "__main__":
    main()
