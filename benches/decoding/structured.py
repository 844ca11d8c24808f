"""Structured outputs: what a grammar costs and what it saves, side by side in one process, interleaved.

(a) mbd-tiny (embedded), per decoding mode: the same chats free and under a JSON schema, round after round:
    tokens per forward, the share of tokens the grammar forced (written without a forward), ms per token; and a
    grammar the model's answers fit (a regex of digits on sort prompts): forwards free and under it.
(b) Qwen2's real 151,643-token vocabulary (scripts/make_qwen_vocab_fixture.py, from llama-cpp-python's sdist) on
    two random-weight models: the fixture's own (hidden 64: a forward costs little, so the grammar's work per step
    shows in milliseconds) and a Qwen2.5-0.5B-shaped one (bf16, scripts/make_checkpoint.py: the grammar's share of
    a real forward). The grammar's setup (the token environment, once per model: the first constrained request's
    time less the second's), and ms per forward free and constrained, interleaved at the same number of forwards.
(c) The speculative decoders under the schema: S2D2 on mbd-tiny, ISD (greedy, sampled) and AR on the I-DLM twin
    loaded as I-DLM (causal, shifted logits): tokens per forward and drafts accepted, free and constrained.
(d) The tools twin (models/mbd-tools-tiny) on held-out weather/time requests (training/tool_tasks.py), per decoding
    mode: its call written free (tool_choice "none": the tools listed, no grammar, the text read as a call
    afterwards), under the lazy grammar ("auto": free until `<tool_call>`) and constrained throughout ("required"):
    tokens per forward, forced tokens, calls that parse, calls that are right.

    python benches/decoding/structured.py [--model /tmp/mbd-bench/qwen2.5-0.5b-shape-bf16]
        [--sdist ~/.cache/mbd-rs/llama_cpp_python-0.3.36.tar.gz] [--rounds 3] [--skip-big]
Writes structured.json in benches/results/decoding/ (with --skip-big, the big-model results of the file's last
full run are kept, under their own commit).
"""
import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
               "maxItems": 6},
    "confident": {"type": "boolean"}}, "required": ["answer", "confident"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
PROMPTS = ["sort 5 3 8 1", "reverse a b c", "add 12+34", "count a in abca", "repeat ab 3", "sort 9 7 1 4 2"]
MODES = {"ar": dict(block_size=1), "multi-block": dict(), "confidence": dict(acceptance="confidence", threshold=0.9),
         "sampled": dict(temperature=1.0, seed=0)}


def cpu_flags():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    return "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")


def tiny(rounds):
    eng = mbd_rs.Engine.load()
    rows = []
    for name, kw in MODES.items():
        acc = {"free": [], "schema": []}
        for _ in range(rounds):
            for how in ("free", "schema"):
                extra = dict(response_format=FORMAT) if how == "schema" else {}
                tok = fwd = forced = 0
                t0 = time.perf_counter()
                for p in PROMPTS:
                    c = eng.chat([{"role": "user", "content": p}], max_tokens=48, **kw, **extra)
                    tok += len(c.token_ids)
                    fwd += c.usage.forward_passes
                    forced += c.usage.forced_tokens
                ms = (time.perf_counter() - t0) * 1e3
                acc[how].append(dict(tokens=tok, forwards=fwd, forced=forced, ms=ms))
        row = {"mode": name}
        for how, runs in acc.items():
            r = runs[-1]
            row[how] = dict(tokens=r["tokens"], forwards=r["forwards"], forced=r["forced"],
                            tokens_per_forward=r["tokens"] / r["forwards"],
                            ms_per_token=statistics.median(x["ms"] / x["tokens"] for x in runs))
        row["forwards_ratio"] = row["schema"]["forwards"] / row["free"]["forwards"]
        rows.append(row)
        print(f"tiny {name:12s} free {row['free']['tokens_per_forward']:.2f} tok/fwd "
              f"{row['free']['ms_per_token']:.2f} ms/tok | schema {row['schema']['tokens_per_forward']:.2f} tok/fwd "
              f"({row['schema']['forced']}/{row['schema']['tokens']} forced) {row['schema']['ms_per_token']:.2f} ms/tok",
              flush=True)
    return rows


SPECULATIVE = [
    ("mbd-tiny", {}, "s2d2 (default routing)", dict(speculative="s2d2")),
    ("mbd-tiny", {}, "s2d2 (every span verified)", dict(speculative="s2d2", verify_policy="always")),
    ("mbd-idlm-tiny", dict(attention="causal", logits_shift=True), "ar", dict(block_size=1)),
    ("mbd-idlm-tiny", dict(attention="causal", logits_shift=True), "isd", dict(speculative="isd")),
    ("mbd-idlm-tiny", dict(attention="causal", logits_shift=True), "isd sampled",
     dict(speculative="isd", temperature=1.0, seed=0)),
]


def speculative():
    """S2D2 and ISD, free and under the schema: tokens, forwards, forced tokens, drafts proposed and accepted."""
    rows, engines = [], {}
    for model, load, name, kw in SPECULATIVE:
        key = (model, tuple(sorted(load.items())))
        if key not in engines:
            engines[key] = mbd_rs.Engine.load(None if model == "mbd-tiny" else os.path.join(ROOT, "models", model),
                                              **load)
        eng = engines[key]
        row = {"model": model, "mode": name}
        for how in ("free", "schema"):
            extra = dict(response_format=FORMAT) if how == "schema" else {}
            t = dict(tokens=0, forwards=0, forced=0, drafts_proposed=0, drafts_accepted=0)
            for p in PROMPTS:
                c = eng.chat([{"role": "user", "content": p}], max_tokens=48, **kw, **extra)
                u = c.usage
                t["tokens"] += len(c.token_ids)
                t["forwards"] += u.forward_passes
                t["forced"] += u.forced_tokens
                t["drafts_proposed"] += u.drafts_proposed
                t["drafts_accepted"] += u.drafts_accepted
            t["tokens_per_forward"] = t["tokens"] / t["forwards"]
            row[how] = t
        rows.append(row)
        f, g = row["free"], row["schema"]
        print(f"{model} {name:28s} free {f['tokens_per_forward']:.2f} tok/fwd ({f['drafts_accepted']}/"
              f"{f['drafts_proposed']} drafts) | schema {g['tokens_per_forward']:.2f} tok/fwd ({g['forced']}/"
              f"{g['tokens']} forced, {g['drafts_accepted']}/{g['drafts_proposed']} drafts)", flush=True)
    return rows


TOOL_MODES = {"ar": dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0),
              "multi-block": dict(), "confidence": dict(block_size=4, acceptance="confidence", threshold=0.9)}


def tools(n):
    """The tools twin's calls free, under the lazy grammar and constrained throughout: per decoding mode, over `n`
    held-out requests."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "training"))
    from tool_tasks import held_out_calls
    from mbd_rs.tools import parse
    eng = mbd_rs.Engine.load(os.path.join(ROOT, "models", "mbd-tools-tiny"))
    cases = held_out_calls(n)
    rows = []
    for name, kw in TOOL_MODES.items():
        row = {"mode": name}
        for choice in ("none", "auto", "required"):
            t = dict(tokens=0, forwards=0, forced=0, parsed=0, right=0)
            for msgs, tl, fn, city in cases:
                c = eng.chat(msgs, tools=tl, tool_choice=choice, max_tokens=96, **kw)
                t["tokens"] += len(c.token_ids)
                t["forwards"] += c.usage.forward_passes
                t["forced"] += c.usage.forced_tokens
                calls = c.tool_calls if choice != "none" else parse(eng.tool_plan(tl).format, c.text)[1]
                ok = len(calls) == 1
                try:
                    args = json.loads(calls[0].arguments) if ok else None
                except ValueError:
                    ok, args = False, None
                t["parsed"] += ok
                t["right"] += ok and calls[0].name == fn and args == {"city": city}
            t["tokens_per_forward"] = t["tokens"] / t["forwards"]
            row[choice] = t
        rows.append(row)
        print("tools " + f"{name:12s} " + " | ".join(
            f"{ch} {row[ch]['tokens_per_forward']:.2f} tok/fwd ({row[ch]['forced']}/{row[ch]['tokens']} forced, "
            f"{row[ch]['parsed']}/{n} parse, {row[ch]['right']}/{n} right)" for ch in ("none", "auto", "required")),
            flush=True)
    return rows


FIT_PROMPTS = ["sort 5 3 8 1 9 2", "sort 9 7 1 4 2 6 3", "sort 4 4 1 0 2", "sort 8 1 6 2 7 3 5", "sort 6 2 9"]
FIT_REGEX = r"[0-9]( [0-9])*"


def tiny_fit():
    """A grammar the model's answers fit (digits separated by spaces, on sort prompts): forwards free and under it."""
    eng = mbd_rs.Engine.load()
    row = {}
    for how, kw in (("free", {}), ("regex", dict(regex=FIT_REGEX))):
        cs = [eng.chat([{"role": "user", "content": p}], max_tokens=32, **kw) for p in FIT_PROMPTS]
        row[how] = dict(tokens=sum(len(c.token_ids) for c in cs), forwards=sum(c.usage.forward_passes for c in cs),
                        texts=[c.text for c in cs])
    print(f"tiny, a grammar the answers fit: free {row['free']['tokens']} tokens in {row['free']['forwards']} "
          f"forwards, regex {row['regex']['tokens']} in {row['regex']['forwards']}", flush=True)
    return row


def big_model(src, sdist, work):
    """`src` (weights linked) with the fixture's Qwen2 tokenizer (its <|MASK|> the mask token)."""
    spec = importlib.util.spec_from_file_location("vocab", os.path.join(ROOT, "scripts", "make_qwen_vocab_fixture.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    paths = mod.build(os.path.join(work, "vocab"), sdist, model=True)
    dst = os.path.join(work, "model")
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("mask_token_id", None)  # found in the tokenizer: <|MASK|>
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    try:
        os.link(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    except OSError:
        os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(paths["model"], name), dst)
    return paths["model"], dst


def big(name, path, rounds, steps):
    eng = mbd_rs.Engine.load(path, device="cpu")
    r = random.Random(0)
    prompt = [r.randrange(1000, 30000) for _ in range(64)]
    kw = dict(max_tokens=64, block_size=8, max_forward_passes=steps)
    setup = []
    for _ in range(2):
        t0 = time.perf_counter()
        eng.generate(prompt, **kw, response_format=FORMAT)
        setup.append((time.perf_counter() - t0) * 1e3)
    runs = {"free": [], "schema": []}
    for _ in range(rounds):
        for how in ("free", "schema"):
            extra = dict(response_format=FORMAT) if how == "schema" else {}
            c = eng.generate(prompt, **kw, **extra)
            u = c.usage
            runs[how].append(dict(ms_per_forward=u.decode_ms / u.forward_passes, forwards=u.forward_passes,
                                  tokens=len(c.token_ids), forced=u.forced_tokens, decode_ms=u.decode_ms))
            print(f"{name} {how:6s} {runs[how][-1]['ms_per_forward']:7.1f} ms/forward {u.forward_passes} forwards "
                  f"{len(c.token_ids)} tokens ({u.forced_tokens} forced)", flush=True)
    free = statistics.median(x["ms_per_forward"] for x in runs["free"])
    schema = statistics.median(x["ms_per_forward"] for x in runs["schema"])
    b = dict(token_environment_ms=setup[0] - setup[1], first_two_constrained_requests_ms=setup,
             free_ms_per_forward=free, schema_ms_per_forward=schema, overhead_ms_per_forward=schema - free,
             ratio=schema / free, runs=runs)
    print(f"{name}: token environment {b['token_environment_ms']:.0f} ms; per forward free {free:.1f} ms, schema "
          f"{schema:.1f} ms (+{schema - free:.1f} ms, ratio {schema / free:.3f})", flush=True)
    return b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape-bf16")
    ap.add_argument("--sdist", default=os.environ.get("MBD_LLAMACPP_SDIST", os.path.expanduser(
        "~/.cache/mbd-rs/llama_cpp_python-0.3.36.tar.gz")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="forward passes per 0.5B run")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--tool-requests", type=int, default=50, help="held-out requests of the tools twin per mode")
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_flags(), "cores": os.cpu_count(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(), "schema": SCHEMA}
    out["tiny"] = tiny(args.rounds)
    out["tiny_fit"] = tiny_fit()
    out["speculative"] = speculative()
    out["tools"] = tools(args.tool_requests)
    dst = os.path.join(ROOT, "benches", "results", "decoding", "structured.json")
    if args.skip_big and os.path.exists(dst):
        with open(dst) as f:
            last = json.load(f)
        for k in ("qwen2_vocab_hidden64", "qwen2_vocab_0.5b"):
            if k in last:
                out[k] = dict(last[k], measured_at=last[k].get("measured_at", last.get("commit")))
    if not args.skip_big:
        with tempfile.TemporaryDirectory() as work:
            small, half_b = big_model(args.model, args.sdist, work)
            out["qwen2_vocab_hidden64"] = big("hidden64", small, args.rounds * 3, args.steps)
            out["qwen2_vocab_0.5b"] = big("0.5B", half_b, args.rounds, args.steps)
    with open(dst, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", dst)


if __name__ == "__main__":
    main()
