"""One attention launch per layer for all of a forward's segments (`_kernels=dict(cuda_segments=True)`, off by
default until a GPU run proves it): run on the GPU machine by `bash benches/gpu/run.sh segments`, or anywhere with
--device cpu as a dry run of the script (there the switch changes nothing).

A random Qwen3 checkpoint with the SDAR-1.7B attention shape (16 query heads of 128, 8 kv heads; 2 layers, a
small vocabulary so that greedy tokens are sensitive to the last bit of the logits) decodes K concurrent streams of
different prompt lengths, block sizes and decoding modes, batched into shared forwards, three ways:
  1. alone, one stream at a time (a launch per kernel, one segment per forward);
  2. alone with cuda_segments on (the one segment through the segment table: its committed length and key ranges
     read from device memory, the attention grid sized by its window only);
  3. batched with a launch per segment (cuda_segments off, the default);
  4. batched with every segment in one launch per kernel (cuda_segments on).
Each stream's tokens and forward count must be the same in all four (batch invariance, and the segment kernels'
arithmetic equal to the per-segment kernels'). Then the streams' tokens/s with the switch off and on, interleaved.
Writes one JSON (--out); exits non-zero on a difference.
"""
import argparse
import json
import os
import shutil
import sys
import threading
import time

import numpy as np

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_checkpoint(path, layers, vocab):
    import torch
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=2048, vocab_size=vocab,
                                   max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, eos_token_id=2, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    c = json.load(open(os.path.join(path, "config.json")))
    c.update(block_size=4, mask_token_id=3)  # the fixture tokenizer's <|MASK|>
    json.dump(c, open(os.path.join(path, "config.json"), "w"), indent=1)
    # a 312-token tokenizer (the requests are token ids; ids past it decode as nothing)
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "parity", "qwen2_gqa_tied", "tokenizer.json"), path)


def requests(k, vocab):
    rng = np.random.default_rng(0)
    modes = [dict(block_size=4), dict(block_size=32), dict(block_size=8),
             dict(block_size=1), dict(block_size=16, threshold=0.5)]
    out = []
    for i in range(k):
        n = int(rng.integers(3, 400))  # prompts of different lengths: caches of different sizes side by side
        kw = dict(max_tokens=int(rng.integers(16, 64)), temperature=0.0, early_stop=False, **modes[i % len(modes)])
        out.append((rng.integers(4, vocab, n).tolist(), kw))
    return out


def run(eng, reqs, together):
    """Each request's (tokens, forwards): concurrently (batched by the scheduler) or one after another."""
    res = [None] * len(reqs)

    def one(i):
        c = eng.generate(reqs[i][0], **reqs[i][1])
        res[i] = (c.token_ids, c.usage.forward_passes)

    if together:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(reqs)):
            one(i)
    return res


def setup(name, off_kernels, on_kernels):
    """The command line, the checkpoint, an engine with `off_kernels` and one with `on_kernels` (`_kernels`), and the
    streams' requests: (args, off, on, requests); `name` names the default output (gpu_out/gpu_<name>.json)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default="/tmp/mbd-gpu-segments")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=f"gpu_out/gpu_{name}.json")
    args = ap.parse_args()
    make_checkpoint(args.dir, args.layers, args.vocab)
    dtype = "bfloat16" if args.device != "cpu" else "float32"
    off = mbd_rs.Engine.load(args.dir, device=args.device, dtype=dtype, _kernels=off_kernels)
    on = mbd_rs.Engine.load(args.dir, device=args.device, dtype=dtype, _kernels=on_kernels)
    print("device:", on.info.device, on.info.dtype, flush=True)
    return args, off, on, requests(args.streams, args.vocab)


def finish(name, report, failures, t0, out):
    """Writes `report` with its `failures` to `out`, prints them, and exits non-zero when there are any."""
    report["failures"] = failures
    report["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    for line in failures[:20]:
        print("FAIL", line)
    print(f"{name}:", "ok" if not failures else f"{len(failures)} differences", f"({report['seconds']} s)")
    sys.exit(1 if failures else 0)


def main():
    t0 = time.time()
    args, off, on, reqs = setup("segments", {}, dict(cuda_segments=True))
    alone = run(off, reqs, together=False)
    failures = []
    for i, (g, a) in enumerate(zip(run(on, reqs, together=False), alone)):
        if g != a:
            failures.append(f"cuda_segments on: stream {i} ({reqs[i][1]}) alone {g[0][:8]}... in {g[1]} forwards "
                            f"!= off {a[0][:8]}... in {a[1]}")
    report = {"device": on.info.device, "streams": args.streams, "rounds": []}
    for r in range(args.rounds):
        row = {}
        for name, eng in (("off", off), ("on", on)):
            t = time.perf_counter()
            got = run(eng, reqs, together=True)
            wall = time.perf_counter() - t
            same = sum(g == a for g, a in zip(got, alone))
            for i, (g, a) in enumerate(zip(got, alone)):
                if g != a:
                    failures.append(f"round {r} cuda_segments {name}: stream {i} ({reqs[i][1]}) batched "
                                    f"{g[0][:8]}... in {g[1]} forwards != alone {a[0][:8]}... in {a[1]}")
            tokens = sum(len(g[0]) for g in got)
            row[name] = dict(identical=f"{same}/{len(reqs)}", tokens_per_s=round(tokens / wall, 1))
        report["rounds"].append(row)
        print(f"round {r}: {row}", flush=True)
    finish("segments", report, failures, t0, args.out)


if __name__ == "__main__":
    main()
