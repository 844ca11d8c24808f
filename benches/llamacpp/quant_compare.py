"""One decode forward on the CPU, mbd-rs against llama.cpp, same random checkpoint, several weight formats.

The computation on both sides: a W-token window at positions P..P+W-1 over a P-token KV cache, logits for every
window row, the window dropped from the cache again after each forward (mbd-rs: Model.bench_forward; llama.cpp:
benches/llamacpp/driver.cpp on the public llama.h API, f16 KV cache, flash attention off and on). Same thread
count on both sides. The engines alternate over --rounds rounds (the machine is shared: only same-round ratios
mean much); numbers are medians over all repetitions, ratios are mbd-rs / llama.cpp paired within a round (median
over rounds). The bandwidth floor of a format is its weight bytes over the measured 2-thread read bandwidth (the
median of the rounds' readings): the time a W = 1 forward cannot beat when it streams every weight once.

Formats (mbd-rs side / llama.cpp side):
    f32    f32 checkpoint, f32 weights         / model-f32.gguf
    bf16   bf16 checkpoint, bf16 weights       / model-bf16.gguf and model-f16.gguf (llama.cpp's best 16-bit path)
    q8_0   bf16 checkpoint, quantize="q8_0"    / model-q8_0.gguf
    q4_k   bf16 checkpoint, quantize="q4_k"    / model-q4_k_m.gguf (Q4_K_M; on hidden 896 most of it falls back to
                                                  Q5_0/Q8_0, see benches/llamacpp/README.md)
    q5_k   bf16 checkpoint, quantize="q5_k"    / model-q5_k_m.gguf (Q5_K_M: on hidden 896 mostly Q5_1, which mbd-rs
                                                  holds as q8_0; use a shape of whole super-blocks, e.g. hidden 1024)
    q6_k   bf16 checkpoint, quantize="q6_k"    / model-q6_k.gguf
    q4_0   bf16 checkpoint, quantize="q4_0"    / model-q4_0.gguf
    q3_k   bf16 checkpoint, quantize="q3_k"    / model-q3_k_m.gguf (Q3_K_M: q3_k with q4_k/q5_k for some matrices)
    q2_k   bf16 checkpoint, quantize="q2_k"    / model-q2_k.gguf (Q2_K: q2_k with q3_k/q4_k for some matrices)
mbd-rs runs the quantized formats with int8_activations=False (the exact products of the quantized weights). With
--int8, it runs each quantized format twice per round: so, and with int8_activations=True (integer dot products on
activations rounded to 8 bits, llama.cpp's own arithmetic; the default for quantized weights on CPUs with AVX2):
the "i8" columns.
With --same-file, mbd-rs loads the quantized formats from the very GGUF file llama.cpp runs (model-q8_0.gguf,
model-q4_k_m.gguf, model-q6_k.gguf in --gguf-dir; such files must carry a vocabulary mbd-rs reads: write the f32
GGUF with scripts/write_gguf.py and quantize it with llama-quantize, see benches/llamacpp/README.md): the same
bytes on both sides.
With --avx2 both engines run on AVX2 only, as on a CPU without AVX-512 (a Zen 3, say): mbd-rs's products with
`_kernels=dict(packed_avx512=False)`, llama.cpp as built by `LLAMACPP_ISA=avx2 benches/llamacpp/build.sh`.

    benches/llamacpp/build.sh && benches/llamacpp/convert.sh /tmp/mbd-bench/qwen2.5-0.5b-shape-bf16 /tmp/llamacpp/gguf
    python scripts/make_bench_model.py                      # the f32 checkpoint (the bf16 one: --bf16)
    python benches/llamacpp/quant_compare.py [--formats f32,bf16,q8_0,q4_k] [--llama-only q8_0] [--rounds 3] [--reps 5]
Writes benches/results/llamacpp/quant_compare.json (every repetition, per-round medians, the summary; --out) and
prints a markdown table.
Before each measured block it waits (--wait-idle seconds at most) until the other processes use under
--idle-cores of CPU, and it records how much CPU others used during the block (other_cores).
"""
import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMATS = ("f32", "bf16", "q8_0", "q4_k", "q5_k", "q6_k", "q4_0", "q3_k", "q2_k")
QUANTIZE = {f: f for f in FORMATS[2:]}  # mbd-rs load-time quantization per format
GGUFS = {"f32": ("f32",), "bf16": ("bf16", "f16"), "q8_0": ("q8_0",), "q4_k": ("q4_k_m",), "q5_k": ("q5_k_m",),
         "q6_k": ("q6_k",), "q4_0": ("q4_0",), "q3_k": ("q3_k_m",), "q2_k": ("q2_k",)}
SEEN_STDERR = set()


def parse_list(s, allowed, what):
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        sys.exit(f"quant_compare: unknown {what} {', '.join(bad)} (known: {', '.join(allowed)})")
    return items


def cpu_jiffies():
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is already counted in user
    return total - idle, total


def own_cpu_seconds():
    """CPU seconds used so far by this process (all threads) and by its waited-for children."""
    t = os.times()
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t.user + t.system + c.ru_utime + c.ru_stime


class Contention:
    """CPU the rest of the machine used while a block ran, in cores (0 = we had the machine alone)."""

    def __enter__(self):
        self.j0, self.c0, self.t0 = cpu_jiffies(), own_cpu_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc):
        (b1, t1), c1, t = cpu_jiffies(), own_cpu_seconds(), time.monotonic()
        b0, tt0 = self.j0
        ncpu = os.cpu_count() or 1
        elapsed = max(t - self.t0, 1e-9)
        busy_cores = (b1 - b0) / max(t1 - tt0, 1) * ncpu
        self.other_cores = max(0.0, busy_cores - (c1 - self.c0) / elapsed)
        self.seconds = elapsed
        return False


def wait_idle(max_wait, idle_cores, log):
    """Wait until the machine's busy CPU (we are idle meanwhile) is below idle_cores, at most max_wait seconds.
    Returns the busy cores seen last and the seconds waited."""
    t0 = time.monotonic()
    ncpu = os.cpu_count() or 1
    warned = False
    while True:
        b0, tt0 = cpu_jiffies()
        time.sleep(1.0)
        b1, tt1 = cpu_jiffies()
        busy = (b1 - b0) / max(tt1 - tt0, 1) * ncpu
        waited = time.monotonic() - t0
        if busy < idle_cores or waited >= max_wait:
            if busy >= idle_cores:
                log(f"  (machine still busy, {busy:.2f} cores, after {waited:.0f} s: measuring anyway)")
            return busy, waited
        if not warned:
            log(f"  waiting for the machine to go idle ({busy:.2f} cores busy)...")
            warned = True
        time.sleep(4.0)


def run_driver(driver, args, log):
    """Run the llama.cpp driver; returns its JSON lines (stderr is shown on failure)."""
    p = subprocess.run([driver] + args, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"quant_compare: {driver} {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    for x in p.stderr.splitlines():  # llama.cpp's warnings, each once
        if x.strip() and x not in SEEN_STDERR:
            SEEN_STDERR.add(x)
            log("  llama.cpp: " + x)
    return lines


def check_mbd_formats(mbd_rs, formats):
    """Fail early, and clearly, when this mbd_rs build cannot load a format (probe on the embedded tiny model)."""
    for fmt in formats:
        if fmt not in QUANTIZE:
            continue
        try:
            eng = mbd_rs.Engine.load(device="cpu", quantize=QUANTIZE[fmt])
        except Exception as e:  # TypeError (no such argument) or the engine's own error for an unknown format
            sys.exit(f"quant_compare: this mbd_rs build cannot load format {fmt!r} "
                     f"(Engine.load(..., quantize={QUANTIZE[fmt]!r}) raised {type(e).__name__}: {e}).\n"
                     f"Run the formats it supports on the mbd-rs side, e.g. --formats f32,bf16 "
                     f"(--llama-only {fmt} still measures llama.cpp).")
        del eng


def median_ms(xs):
    return statistics.median(xs) if xs else None


def fmt_ms(x):
    return "—" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def fmt_ratio(x):
    return "—" if x is None else f"{x:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="formats measured on both sides")
    ap.add_argument("--llama-only", default="", help="formats measured on the llama.cpp side only")
    ap.add_argument("--cases", default="0:1,512:1,512:4,512:16,512:32", help="P:W pairs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed forwards per case and round (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fa", default="0,1", help="llama.cpp flash attention settings to run (0 off, 1 on)")
    ap.add_argument("--model-f32", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
    ap.add_argument("--model-bf16", default="/tmp/mbd-bench/qwen2.5-0.5b-shape-bf16")
    ap.add_argument("--gguf-dir", default="/tmp/llamacpp/gguf")
    ap.add_argument("--driver", default=None, help="llama.cpp driver (default: build/ or, --avx2, build-avx2/ under "
                    "$LLAMACPP_WORK or /tmp/llamacpp)")
    ap.add_argument("--avx2", action="store_true",
                    help="both engines on AVX2 only, as on a CPU without AVX-512 (Zen 3 and earlier): mbd-rs with "
                         "_kernels=dict(packed_avx512=False), llama.cpp built by LLAMACPP_ISA=avx2 build.sh")
    ap.add_argument("--no-f16", action="store_true", help="skip llama.cpp's f16 GGUF next to bf16")
    ap.add_argument("--same-file", action="store_true",
                    help="mbd-rs loads the quantized formats from llama.cpp's GGUF files (the same bytes)")
    ap.add_argument("--wait-idle", type=float, default=180.0, help="seconds to wait at most for an idle machine")
    ap.add_argument("--idle-cores", type=float, default=0.3, help="busy CPU (cores) that still counts as idle")
    ap.add_argument("--int8", action="store_true",
                    help="also run mbd-rs's quantized formats with int8_activations=True (the i8 columns)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "llamacpp", "quant_compare.json"))
    args = ap.parse_args()

    if args.driver is None:
        args.driver = os.path.join(os.environ.get("LLAMACPP_WORK", "/tmp/llamacpp"),
                                   "build-avx2" if args.avx2 else "build", "bin", "mbd-llama-driver")
    formats = parse_list(args.formats, FORMATS, "format")
    llama_only = [f for f in parse_list(args.llama_only, FORMATS, "format") if f not in formats]
    cases = []
    for c in args.cases.split(","):
        try:
            p, w = map(int, c.split(":"))
        except ValueError:
            sys.exit(f"quant_compare: case {c!r} is not P:W")
        cases.append((p, w))
    fas = [int(x) for x in args.fa.split(",") if x.strip()]
    all_formats = [f for f in FORMATS if f in formats or f in llama_only]
    gguf_of = {f: [g for g in GGUFS[f] if not (args.no_f16 and g == "f16")] for f in all_formats}
    for f in all_formats:
        for g in gguf_of[f]:
            path = os.path.join(args.gguf_dir, f"model-{g}.gguf")
            if not os.path.isfile(path):
                sys.exit(f"quant_compare: no {path}: run benches/llamacpp/convert.sh (see benches/llamacpp/README.md)")
    if not os.access(args.driver, os.X_OK):
        sys.exit(f"quant_compare: no driver at {args.driver}: run benches/llamacpp/build.sh")
    # the quantized formats are made at load from the bf16 checkpoint (or, --same-file, read from the GGUF)
    mbd_dir = {"f32": args.model_f32, "bf16": args.model_bf16, **{f: args.model_bf16 for f in QUANTIZE}}
    if args.same_file:
        mbd_dir.update({f: os.path.join(args.gguf_dir, f"model-{GGUFS[f][0]}.gguf") for f in QUANTIZE})
    for f in formats:
        if args.same_file and f in QUANTIZE:
            continue  # the GGUF file, checked above
        if not os.path.isfile(os.path.join(mbd_dir[f], "config.json")):
            sys.exit(f"quant_compare: no checkpoint at {mbd_dir[f]} for {f}: run scripts/make_bench_model.py "
                     f"{'--bf16' if f != 'f32' else ''}")

    # the rayon pool reads this once, at first use: set it before mbd_rs starts any work
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import mbd_rs
    check_mbd_formats(mbd_rs, formats)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    case_arg = ",".join(f"{p}:{w}" for p, w in cases)
    bandwidth = []  # one driver --bandwidth result per round
    # mbd-rs variants: each format as it is, and (--int8) its int8_activations twin "<format>+i8"
    variants = {f: [(f, False)] + ([(f + "+i8", True)] if args.int8 and f in QUANTIZE else []) for f in formats}
    mbd = {key: {"rounds": []} for f in formats for key, _ in variants[f]}  # rounds: [{case key: [ms...]}]
    llama = {(g, fa): {"format": f, "gguf": g, "flash_attn": fa, "rounds": []}
             for f in all_formats for g in gguf_of[f] for fa in fas}
    blocks = []  # contention record per measured block
    t_start = time.time()
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        busy, waited = wait_idle(args.wait_idle, args.idle_cores, log)
        with Contention() as cn:
            bw = run_driver(args.driver, ["--bandwidth", "--threads", str(args.threads)], log)[0]
        bw.update(round=r, other_cores=cn.other_cores, busy_before=busy)
        bandwidth.append(bw)
        log(f"  read bandwidth {bw['best_gbs']:.1f} GB/s (best of {bw['tries']}), others {cn.other_cores:.2f} cores")
        order = all_formats[r % len(all_formats):] + all_formats[:r % len(all_formats)]  # rotate the order
        for f in order:
            for key, int8 in variants.get(f, []):
                busy, waited = wait_idle(args.wait_idle, args.idle_cores, log)
                kw = {"quantize": QUANTIZE[f]} if f in QUANTIZE and not args.same_file else {}
                kw["int8_activations"] = int8  # False: the exact products (the default is int8 on AVX2 CPUs)
                if args.avx2:
                    kw["_kernels"] = dict(packed_avx512=False)
                t = time.perf_counter()
                eng = mbd_rs.Engine.load(mbd_dir[f], device="cpu", **kw)
                load_s = time.perf_counter() - t
                info = eng.info
                res = {"round": r, "load_s": load_s, "weight_bytes": info.weight_bytes,
                       "weight_format": getattr(info, "weight_format", None), "times_ms": {}}
                with Contention() as cn:
                    for p, w in cases:
                        secs = eng._core.bench_forward(p, w, args.reps + 1)[1:]  # the first is a warm-up
                        res["times_ms"][f"{p}:{w}"] = [1e3 * s for s in secs]
                res.update(other_cores=cn.other_cores, busy_before=busy, seconds=cn.seconds)
                mbd[key]["rounds"].append(res)
                mbd[key]["weight_bytes"] = info.weight_bytes
                mbd[key]["weight_format"] = res["weight_format"]
                del eng, info
                gc.collect()
                blocks.append(dict(round=r, side="mbd-rs", format=key, other_cores=cn.other_cores))
                log(f"  mbd-rs {key:5s}: " + "  ".join(f"{k} {median_ms(v):.1f}" for k, v in res["times_ms"].items())
                    + f"  ms  (load {load_s:.1f} s, others {cn.other_cores:.2f} cores)")
            for g in gguf_of[f]:
                for fa in fas:
                    busy, waited = wait_idle(args.wait_idle, args.idle_cores, log)
                    with Contention() as cn:
                        lines = run_driver(args.driver, [os.path.join(args.gguf_dir, f"model-{g}.gguf"), "--threads",
                                                         str(args.threads), "--cases", case_arg, "--reps",
                                                         str(args.reps), "--fa", str(fa)], log)
                    model = next(x for x in lines if x["kind"] == "model")
                    res = {"round": r, "load_ms": model["load_ms"], "times_ms": {}, "fill_ms": {},
                           "other_cores": cn.other_cores, "busy_before": busy, "seconds": cn.seconds}
                    for x in lines:
                        if x["kind"] == "case":
                            res["times_ms"][f"{x['prefix']}:{x['window']}"] = x["times_ms"]
                            res["fill_ms"][f"{x['prefix']}:{x['window']}"] = x["fill_ms"]
                    e = llama[(g, fa)]
                    e["rounds"].append(res)
                    e.update(size_bytes=model["size_bytes"], desc=model["desc"], system=model["system"])
                    blocks.append(dict(round=r, side="llama.cpp", format=f, gguf=g, flash_attn=fa,
                                       other_cores=cn.other_cores))
                    log(f"  llama  {g:6s} fa={fa}: " + "  ".join(f"{k} {median_ms(v):.1f}"
                                                               for k, v in res["times_ms"].items())
                        + f"  ms  (others {cn.other_cores:.2f} cores)")

    # ---- summary -------------------------------------------------------------------------------------------
    # the floor's bandwidth: the median of the rounds' readings (each the best of its tries). Not the best over
    # rounds: on a shared VM one reading was once 61.5 GB/s between two of 33-36, implausible for DRAM on 2 threads.
    floor_bw = statistics.median(b["best_gbs"] for b in bandwidth)
    rows = []
    for f in all_formats:
        for g in gguf_of[f]:
            for p, w in cases:
                k = f"{p}:{w}"
                row = {"format": f, "gguf": g, "prefix": p, "window": w}
                ours = {}  # "" (as it is) or "i8_" (int8_activations) -> per-round times
                for key, int8 in variants.get(f, []):
                    tag = "i8_" if int8 else ""
                    ours[tag] = [x["times_ms"][k] for x in mbd[key]["rounds"]]
                    row[f"mbd_rs_{tag}ms"] = median_ms([t for rr in ours[tag] for t in rr])
                    row[f"mbd_rs_{tag}floor_ms"] = 1e3 * mbd[key]["weight_bytes"] / (floor_bw * 1e9)
                for fa in fas:
                    e = llama[(g, fa)]
                    theirs = [x["times_ms"][k] for x in e["rounds"]]
                    row[f"llama_fa{fa}_ms"] = median_ms([t for rr in theirs for t in rr])
                    row["llama_floor_ms"] = 1e3 * e["size_bytes"] / (floor_bw * 1e9)
                    for tag, times in ours.items():
                        paired = [median_ms(a) / median_ms(b) for a, b in zip(times, theirs)]
                        row[f"ratio_{tag}fa{fa}"] = median_ms(paired)
                        row[f"ratio_{tag}fa{fa}_per_round"] = paired
                rows.append(row)

    def git(*a):
        try:
            return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()
        except OSError:
            return None

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out = dict(
        what="one decode forward (W-token window over a P-token KV cache, logits for every row), CPU",
        machine=dict(cpu=cpu, cores=os.cpu_count(), platform=platform.platform()),
        mbd_rs=dict(git=git("rev-parse", "HEAD"), dirty=bool(git("status", "--porcelain", "--", "crates", "python")),
                    version=getattr(mbd_rs, "__version__", None)),
        llama_cpp=dict(source="llama-cpp-python 0.3.36 sdist, vendor/llama.cpp", driver=args.driver,
                       system=next((e.get("system") for e in llama.values() if e.get("system")), None),
                       kv_cache="f16", flash_attn=fas),
        args=vars(args), cases=[f"{p}:{w}" for p, w in cases], threads=args.threads, rounds=args.rounds,
        reps=args.reps, floor_bandwidth_gbs=floor_bw, bandwidth=bandwidth,
        weight_bytes={**{f"mbd-rs {key}": v.get("weight_bytes") for key, v in mbd.items()},
                      **{f"llama.cpp {e['gguf']}": e.get("size_bytes") for e in llama.values()}},
        weight_format={f"mbd-rs {key}": v.get("weight_format") for key, v in mbd.items()},
        max_other_cores=max((b["other_cores"] for b in blocks), default=0.0), blocks=blocks,
        seconds=time.time() - t_start, rows=rows,
        raw=dict(mbd_rs=mbd, llama_cpp=[v for v in llama.values()]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)

    # ---- markdown ------------------------------------------------------------------------------------------
    fa_cols = "".join(f" llama.cpp FA {'on' if fa else 'off'} ms |" for fa in fas)
    tags = [""] + (["i8_"] if args.int8 else [])
    ratio_cols = "".join(f" mbd{'.i8' if t else ''}/llama FA {'on' if fa else 'off'} |" for t in tags for fa in fas)
    print(f"\n{cpu}, {args.threads} threads, {args.rounds} round(s) x {args.reps} reps, read bandwidth "
          f"{floor_bw:.1f} GB/s (median of rounds), others used up to {out['max_other_cores']:.2f} cores during a block\n")
    i8_col = " mbd-rs i8 ms |" if args.int8 else ""
    print(f"| format | llama GGUF | P:W | mbd-rs ms |{i8_col}{fa_cols}{ratio_cols} floor mbd-rs ms | floor llama ms |")
    print("|---|---|---|---:|" + "---:|" * (len(tags) - 1 + (1 + len(tags)) * len(fas)) + "---:|---:|")
    for row in rows:
        cells = [row["format"], row["gguf"], f"{row['prefix']}:{row['window']}", fmt_ms(row.get("mbd_rs_ms"))]
        cells += [fmt_ms(row.get("mbd_rs_i8_ms"))] if args.int8 else []
        cells += [fmt_ms(row.get(f"llama_fa{fa}_ms")) for fa in fas]
        cells += [fmt_ratio(row.get(f"ratio_{t}fa{fa}")) for t in tags for fa in fas]
        cells += [fmt_ms(row.get("mbd_rs_floor_ms")), fmt_ms(row.get("llama_floor_ms"))]
        print("| " + " | ".join(cells) + " |")
    print("\nweight bytes: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in out["weight_bytes"].items() if v))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
