"""Loading a GGUF file against quantizing a safetensors checkpoint at load: time to load, peak RSS, one forward.

    python scripts/make_bench_model.py /tmp/mbd-bench/qwen2.5-0.5b-shape
    python scripts/write_gguf.py /tmp/mbd-bench/qwen2.5-0.5b-shape /tmp/mbd-bench/gguf/q8_0.gguf --type q8_0
    python benches/forward/gguf_load.py --dir /tmp/mbd-bench/qwen2.5-0.5b-shape --gguf /tmp/mbd-bench/gguf/q8_0.gguf

Each load runs in a fresh child process (peak RSS is per process); the two sources alternate over --rounds.
"""
import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import mbd_rs
path, quantize = sys.argv[1], sys.argv[2] or None
t = time.perf_counter()
eng = mbd_rs.Engine.load(path, device="cpu", quantize=quantize)
load = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
w1 = sorted(eng._core.bench_forward(0, 1, 5))[2] * 1e3
w16 = sorted(eng._core.bench_forward(0, 16, 3))[1] * 1e3
print(json.dumps(dict(load_s=load, peak_rss_mib=rss, weight_mib=eng.info.weight_bytes / 2**20,
                      format=eng.info.weight_format, w1_ms=w1, w16_ms=w16)))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--quantize", default="q8_0", help="the format the directory is quantized to at load")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    runs = {"gguf": [], "dir": []}
    for _ in range(a.rounds):
        for name, args in (("gguf", [a.gguf, ""]), ("dir", [a.dir, a.quantize])):
            out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| source | format | MiB held | load s | peak RSS MiB | W1 ms | W16 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("load_s", "peak_rss_mib", "w1_ms", "w16_ms")}
        print(f"| {name} | {rs[0]['format']} | {rs[0]['weight_mib']:.1f} | {med['load_s']:.2f} | "
              f"{med['peak_rss_mib']:.0f} | {med['w1_ms']:.1f} | {med['w16_ms']:.1f} |")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
