"""Accuracy vs speed of the embedded mbd-tiny model on the held-out split of its task families.

Suite `modes` (default): AR (block_size 1), single-block (alpha 1.0) and multi-block decoding (alpha 0.1,
beta 0.95) at several thresholds for both acceptance policies and the EB rule (accept in order of entropy while
the accepted entropies sum to at most the threshold). Writes tiny_eval.json and (with matplotlib installed)
tiny_accuracy_vs_tpf.png in benches/results/models-twins/.
Suite `s2d2` (S2D2 self-speculative verification): AR, single-block and multi-block, each plain and with S2D2
verification (always, score, hysteresis); also how often each output equals the AR output. Writes s2d2_tiny.json
and s2d2_tiny.png in benches/results/decoding/.
Suite `cache` (the approximate caches of full-attention models): AR and the cache modes on a Dream-style model
(`--model DIR`). Writes cache_dream.json and .png in benches/results/decoding/.
Suite `quant` (quantized weights): AR, single-block and multi-block with the weights as loaded and quantized at load
(q8_0, q4_k, q4_0; q8_0 and q4_k with int8_activations too: "+i8"): accuracy, tokens per forward and how often each
output equals the unquantized one. Writes quant_tiny.json in benches/results/quantization/.
Suite `methods` (ISD and the 2026 acceptance rules): AR, single-block, multi-block and S2D2 beside TDAR's BACD,
dInfer's CreditDecoding and DUS's dilated schedule, at a few settings each, and I-DLM's ISD at strides 2, 4 and 8
(causal shifted models only: the I-DLM twin, `--load '{"attention": "causal", "logits_shift": true}'`). Writes
methods_tiny.json and methods_tiny.png in benches/results/decoding/.
With `--model DIR` every file name gets the model directory's name (`tiny_eval_<model>.json`, ...).
All configurations run on the same held-out instances, in one process, one after another.

    python benches/decoding/eval_tiny.py [--suite modes|s2d2|cache|quant|methods] [--per-task 40] [--model DIR] \
        [--load JSON]
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "training"))
from tasks import TASKS, correct, held_out_set  # noqa: E402

import mbd_rs  # noqa: E402

CONFIGS = [("AR (block 1)", dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0))]
for tau in (0.9, 0.7):
    CONFIGS.append((f"single-block confidence {tau}", dict(block_size=4, block_add_threshold=1.0, acceptance="confidence", threshold=tau)))
for tau in (0.05, 0.2, 0.5, 1.0, 2.0):
    CONFIGS.append((f"multi-block entropy {tau}", dict(block_size=4, acceptance="entropy", threshold=tau)))
for tau in (0.95, 0.9, 0.7, 0.5, 0.3, 0.1):
    CONFIGS.append((f"multi-block confidence {tau}", dict(block_size=4, acceptance="confidence", threshold=tau)))
for tau in (0.1, 0.5, 1.0):
    CONFIGS.append((f"multi-block EB {tau}", dict(block_size=4, acceptance="eb", threshold=tau)))
for tau in (0.2, 0.5):
    CONFIGS.append((f"multi-block B8 entropy {tau}", dict(block_size=8, acceptance="entropy", threshold=tau)))
for tau in (0.5, 2.0):
    CONFIGS.append((f"multi-block B16 entropy {tau}", dict(block_size=16, acceptance="entropy", threshold=tau)))

S2D2 = dict(speculative="s2d2")
SINGLE = dict(block_size=4, block_add_threshold=1.0, acceptance="confidence", threshold=0.9)
MULTI = dict(block_size=4, acceptance="entropy", threshold=0.5)
S2D2_CONFIGS = [("AR (block 1)", CONFIGS[0][1])]
for mode, base in [("single-block", SINGLE), ("multi-block", MULTI)]:
    S2D2_CONFIGS += [
        (f"{mode}", base),
        (f"{mode} + S2D2 always", dict(base, **S2D2, verify_policy="always")),
        (f"{mode} + S2D2 score", dict(base, **S2D2, verify_policy="score")),
        (f"{mode} + S2D2 hysteresis", dict(base, **S2D2, verify_policy="hysteresis", verify_penalty_kind="dynamic")),
    ]
S2D2_CONFIGS.append(("single-block B8 + S2D2 always", dict(SINGLE, block_size=8, **S2D2, verify_policy="always")))

# full-attention (Dream-style) models: the approximate cache modes, multi-block entropy 0.5 with blocks of 4
CACHE_BASE = dict(block_size=4, acceptance="entropy", threshold=0.5)
CACHE_CONFIGS = [("AR (block 1, no cache)", dict(block_size=1, block_add_threshold=1.0, acceptance="confidence",
                                                threshold=1.0))]
for label, extra in [("none", dict(cache="none")), ("prefix delay 1", dict(cache="prefix", cache_delay=1)),
                     ("prefix delay 2", dict(cache="prefix", cache_delay=2)),
                     ("prefix delay 4", dict(cache="prefix", cache_delay=4)),
                     ("prefix delay 1 refresh 4", dict(cache="prefix", cache_delay=1, refresh_interval=4)),
                     ("prefix delay 1 created", dict(cache="prefix", cache_delay=1, prefix_window="created")),
                     ("prefix delay 2 created", dict(cache="prefix", cache_delay=2, prefix_window="created")),
                     ("dual", dict(cache="dual"))]:
    CACHE_CONFIGS.append((f"multi-block {label}", dict(CACHE_BASE, **extra)))
    CACHE_CONFIGS.append((f"single-block {label}", dict(CACHE_BASE, block_add_threshold=1.0, **extra)))
METHOD_CONFIGS = [("AR (block 1)", CONFIGS[0][1]), ("single-block confidence 0.9", SINGLE),
                  ("multi-block entropy 0.5", MULTI),
                  ("single-block + S2D2 always", dict(SINGLE, **S2D2, verify_policy="always"))]
for b in (4, 8):
    METHOD_CONFIGS += [
        (f"BACD B{b} [0.6, 0.9]", dict(block_size=b, block_add_threshold=1.0, acceptance="bacd")),
        (f"BACD B{b} [0.3, 0.7]", dict(block_size=b, block_add_threshold=1.0, acceptance="bacd", bacd_lower=0.3,
                                       bacd_upper=0.7)),
        (f"credit B{b} 0.9", dict(block_size=b, block_add_threshold=1.0, acceptance="credit", threshold=0.9)),
        (f"credit B{b} 0.7", dict(block_size=b, block_add_threshold=1.0, acceptance="credit", threshold=0.7)),
        (f"confidence B{b} 0.7 (credit's baseline)", dict(block_size=b, block_add_threshold=1.0,
                                                          acceptance="confidence", threshold=0.7)),
        (f"DUS B{b}", dict(block_size=b, block_add_threshold=1.0, acceptance="dus")),
    ]
METHOD_CONFIGS.append(("DUS B16", dict(block_size=16, block_add_threshold=1.0, acceptance="dus")))
for n in (2, 4, 8):   # I-DLM's decoding: only causal shifted models (the I-DLM twin); skipped elsewhere
    METHOD_CONFIGS.append((f"ISD stride {n}", dict(speculative="isd", isd_stride=n)))
METHOD_CONFIGS += [("AR (block 1) T 0.7", dict(CONFIGS[0][1], temperature=0.7, seed=0)),   # sampled: each stream seeded
                   ("ISD stride 4 T 0.7", dict(speculative="isd", isd_stride=4, temperature=0.7, seed=0))]
QUANT_CONFIGS = [(name, dict(CONFIGS)[name]) for name in ("AR (block 1)", "single-block confidence 0.9",
                                                          "multi-block entropy 0.5", "multi-block B8 entropy 0.5")]
SUITES = {"modes": (CONFIGS, "tiny_eval"), "s2d2": (S2D2_CONFIGS, "s2d2_tiny"), "cache": (CACHE_CONFIGS, "cache_dream"),
          "quant": (QUANT_CONFIGS, "quant_tiny"), "methods": (METHOD_CONFIGS, "methods_tiny")}
# where each suite's JSON and plot go: benches/results/<topic>/, the topic's page beside them
TOPICS = {"modes": "models-twins", "s2d2": "decoding", "cache": "decoding", "quant": "quantization",
          "methods": "decoding"}


def result_path(suite, name):
    return os.path.join(ROOT, "benches", "results", TOPICS[suite], name)
# (quantize, int8_activations); on mbd-tiny (rows of 128-192) q4_k is q5_0 and q3_k, q2_k are q4_0
QUANT_FORMATS = [(None, False), ("q8_0", False), ("q4_k", False), ("q4_0", False), ("q8_0", True), ("q4_k", True)]


def quant_suite(args, data):
    """Every QUANT_CONFIGS configuration for the weights as loaded and each quantize format."""
    rows, reference = [], {}
    for q, int8 in QUANT_FORMATS:
        eng = mbd_rs.Engine.load(args.model, device="cpu", quantize=q, int8_activations=int8)
        fmt = eng.info.weight_format + ("+i8" if int8 else "")
        for name, cfg in QUANT_CONFIGS:
            solved, toks, fwd, outs = 0, 0, 0, []
            for task, p, a in data:
                c = eng.chat([{"role": "user", "content": p}], max_tokens=args.max_tokens, **cfg)
                solved += correct(task, p, a, c.text)
                toks += c.usage.completion_tokens
                fwd += c.usage.forward_passes
                outs.append(c.token_ids)
            base = reference.setdefault(name, outs)
            row = dict(weights=fmt, weight_bytes=eng.info.weight_bytes, config=name, accuracy=solved / len(data),
                       tokens_per_forward=toks / fwd, same_as_unquantized=sum(o == r for o, r in zip(outs, base)) / len(data))
            rows.append(row)
            print(f"{fmt:9s} {eng.info.weight_bytes / 2**20:6.2f} MiB  {name:28s} acc {row['accuracy'] * 100:5.1f}%  "
                  f"tpf {row['tokens_per_forward']:.2f}  =unquantized {row['same_as_unquantized'] * 100:5.1f}%", flush=True)
        del eng
    out = dict(model=args.model or "mbd-tiny (embedded)", instances=len(data), max_tokens=args.max_tokens, results=rows)
    json.dump(out, open(result_path("quant", "quant_tiny.json"), "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-task", type=int, default=40)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--suite", choices=list(SUITES), default="modes")
    ap.add_argument("--load", default="{}", help='Engine.load keyword arguments as JSON, e.g. for the I-DLM twin '
                    '\'{"attention": "causal", "logits_shift": true}\'')
    args = ap.parse_args()
    data = held_out_set(args.per_task)
    if args.suite == "quant":
        return quant_suite(args, data)
    eng = mbd_rs.Engine.load(args.model, device="cpu", **json.loads(args.load))
    results = []
    ar_outputs = None
    outputs_of = {}
    configs, stem = SUITES[args.suite]
    if args.model:  # another model's results go beside the embedded model's, not over them
        stem += "_" + os.path.basename(os.path.normpath(args.model))
    for name, cfg in configs:
        solved, toks, fwd, secs, same_as_ar, positions = 0, 0, 0, 0.0, 0, 0
        ver, proposed, accepted = 0, 0, 0
        per_task = {t: [0, 0] for t in TASKS}
        outputs = []
        try:  # a method that does not apply to this model (e.g. S2D2 on an unshifted one) is a clear error: skipped
            eng.chat([{"role": "user", "content": data[0][1]}], max_tokens=1, **cfg)
        except mbd_rs.InvalidRequestError as e:
            print(f"{name:34s} does not apply to this model: {e}", flush=True)
            continue
        for task, p, a in data:
            t = time.perf_counter()
            c = eng.chat([{"role": "user", "content": p}], max_tokens=args.max_tokens, **cfg)
            secs += time.perf_counter() - t
            ok = correct(task, p, a, c.text)
            solved += ok
            per_task[task][0] += ok
            per_task[task][1] += 1
            toks += c.usage.completion_tokens
            fwd += c.usage.forward_passes
            positions += c.usage.positions_forwarded
            ver, proposed, accepted = ver + c.usage.verifications, proposed + c.usage.drafts_proposed, accepted + c.usage.drafts_accepted
            outputs.append(c.token_ids)
        if ar_outputs is None:
            ar_outputs = outputs  # the first configuration is AR
        same_as_ar = sum(o == r for o, r in zip(outputs, ar_outputs))
        outputs_of[name] = outputs
        # cache suite: agreement with the same decoding mode without a cache (the approximation's effect)
        base = outputs_of.get(name.split(" ")[0] + " none")
        row = dict(config=name, params=cfg, accuracy=solved / len(data), tokens_per_forward=toks / fwd,
                   forwards_per_token=fwd / toks, tokens_per_second=toks / secs, same_as_ar=same_as_ar / len(data),
                   verifications=ver, draft_acceptance=accepted / proposed if proposed else None,
                   positions_per_forward=positions / fwd,
                   same_as_no_cache=sum(o == r for o, r in zip(outputs, base)) / len(data) if base else None,
                   per_task={k: v[0] / v[1] for k, v in per_task.items()})
        results.append(row)
        acc_s = f"  accept {row['draft_acceptance'] * 100:4.1f}%" if proposed else ""
        print(f"{name:34s} acc {row['accuracy'] * 100:5.1f}%  tpf {row['tokens_per_forward']:.2f}  "
              f"{row['tokens_per_second']:7.0f} tok/s  =AR {row['same_as_ar'] * 100:5.1f}%{acc_s}  "
              f"pos/fwd {row['positions_per_forward']:.0f}  "
              + (f"=none {row['same_as_no_cache'] * 100:5.1f}%  " if base else "")
              + " ".join(f"{k}:{v * 100:.0f}" for k, v in row["per_task"].items()), flush=True)
    out = dict(model=eng.info.path, instances=len(data), max_tokens=args.max_tokens, results=results)
    json.dump(out, open(result_path(args.suite, stem + ".json"), "w"), indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if args.suite in ("s2d2", "cache", "methods"):
        for i, r in enumerate(results):   # markers cycle with a period (17) prime to the colours' (10)
            mk = "sovD^<>px*hH+8d|_"[i % 17]
            ax.plot([r["tokens_per_forward"]], [100 * r["accuracy"]], marker=mk, linestyle="", label=r["config"])
        ax.set_xlabel("tokens per forward" + (" (verification forwards counted)" if args.suite == "s2d2" else ""))
        ax.set_ylabel("held-out accuracy (%, tasks.correct)")
        ax.set_title(f"{os.path.basename(eng.info.path)}: {args.suite} ({len(data)} held-out instances)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(result_path(args.suite, stem + ".png"), dpi=110)
        return
    for label, pick, mk in [("AR", "AR", "s"), ("single-block", "single", "^"), ("multi-block entropy", "multi-block entropy", "o"),
                            ("multi-block confidence", "multi-block confidence", "D"), ("multi-block EB", "multi-block EB", "v"),
                            ("multi-block B8", "B8", "x"), ("multi-block B16", "B16", "P")]:
        pts = [r for r in results if pick in r["config"]]
        ax.plot([r["tokens_per_forward"] for r in pts], [100 * r["accuracy"] for r in pts], marker=mk, label=label)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("held-out accuracy (%, tasks.correct)")
    ax.set_title(f"{os.path.basename(eng.info.path)}: accuracy vs parallelism ({len(data)} held-out instances)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = stem + ".png" if args.model else "tiny_accuracy_vs_tpf.png"
    fig.savefig(result_path(args.suite, png), dpi=110)


if __name__ == "__main__":
    main()
