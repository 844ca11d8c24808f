"""llama.cpp's own converter on the Qwen3.5 parity fixtures, against scripts/write_gguf.py and mbd-rs's loader.

1. Runs llama.cpp's `convert_hf_to_gguf.py` (the llama.cpp vendored in llama-cpp-python 0.3.36's sdist, as
   benches/llamacpp/build.sh uses; its gguf-py) on tests/fixtures/parity/<fixture> (f32, --no-mtp). Its vocabulary
   step only knows published tokenizers (by a hash of their output): the fixtures' small BPE is named "qwen35"
   for it here; nothing else of the converter is changed.
2. Compares that file with scripts/write_gguf.py's (the writer the tests use): the same tensor names, shapes and
   values, and the same qwen35 keys.
3. With --load: mbd-rs loads llama.cpp's file and its logits are compared with transformers' (the fixture's
   expected.npz), every mask case.

    /tmp/devenv/bin/python benches/llamacpp/check_qwen35_convert.py [--fixtures qwen35_hybrid,...]   # steps 1-2 (torch)
    .venv/bin/python benches/llamacpp/check_qwen35_convert.py --load                                # step 3 (mbd_rs)
Files go to /tmp/qwen35-llamacpp/<fixture>.{llamacpp,ours}.gguf.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARITY = os.path.join(ROOT, "tests", "fixtures", "parity")
SDIST = os.environ.get("MBD_LLAMACPP_SDIST", os.path.expanduser("~/.cache/mbd-rs/llama_cpp_python-0.3.36.tar.gz"))
WORK = "/tmp/qwen35-llamacpp"


def vendored():
    """The sdist's llama.cpp, unpacked once."""
    top = os.path.join(WORK, "sdist")
    lc = os.path.join(top, "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
    if not os.path.exists(os.path.join(lc, "convert_hf_to_gguf.py")):
        os.makedirs(top, exist_ok=True)
        with tarfile.open(SDIST) as t:
            t.extractall(top, members=[m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name
                                       and ("/conversion/" in m.name or "/gguf-py/" in m.name
                                            or m.name.endswith("convert_hf_to_gguf.py"))])
    return lc


CONVERT = """
import sys
sys.path[:0] = [{lc!r}, {lc!r} + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {out!r}, "--outtype", "f32", "--no-mtp"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"  # the fixtures' tokenizer is not a published one
import runpy
runpy.run_path({lc!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(name):
    lc = vendored()
    out = os.path.join(WORK, f"{name}.llamacpp.gguf")
    code = CONVERT.format(lc=lc, src=os.path.join(PARITY, name), out=out)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=WORK)
    return out


def ours(name):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import write_gguf as w
    out = os.path.join(WORK, f"{name}.ours.gguf")
    cfg, tensors = w.read_hf(os.path.join(PARITY, name))
    w.write_gguf(out, cfg, tensors, os.path.join(PARITY, name))
    return out


def compare(a_path, b_path):
    import gguf
    a, b = gguf.GGUFReader(a_path), gguf.GGUFReader(b_path)
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}
    problems = []
    if set(ta) != set(tb):
        problems.append(f"tensor names differ: only llama.cpp {sorted(set(ta) - set(tb))}, "
                        f"only ours {sorted(set(tb) - set(ta))}")
    worst = 0.0
    for n in sorted(set(ta) & set(tb)):
        x, y = np.asarray(ta[n].data, np.float32), np.asarray(tb[n].data, np.float32)
        if x.shape != y.shape:
            problems.append(f"{n}: shape {x.shape} (llama.cpp) vs {y.shape} (ours)")
            continue
        d = float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
        worst = max(worst, d)
        if d > 1e-6:
            problems.append(f"{n}: values differ by {d:.2e} (relative)")
    keys = lambda r: {k: (f.contents() if hasattr(f, "contents") else None) for k, f in r.fields.items()
                      if k.startswith("qwen35")}
    ka, kb = keys(a), keys(b)
    for k in sorted(set(ka) | set(kb)):
        if ka.get(k) != kb.get(k):
            problems.append(f"key {k}: {ka.get(k)} (llama.cpp) vs {kb.get(k)} (ours)")
    return problems, worst, len(ta)


def load(name, path):
    import mbd_rs
    meta = json.load(open(os.path.join(PARITY, "cases.json")))
    exp = np.load(os.path.join(PARITY, name, "expected.npz"))
    eng = mbd_rs.Engine.load(path, device="cpu")
    errs = {}
    for case, c in meta["cases"].items():
        got = eng.logits(exp["ids"], attention=c["attention"], block_size=c["block_size"], alignment=c["alignment"],
                         prompt_len=c["prompt_len"])
        errs[case] = float(np.abs(got - exp[case]).max() / np.abs(exp[case]).max())
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="qwen35_hybrid,qwen35_mixed_tied,qwen35moe_top2_shared")
    ap.add_argument("--load", action="store_true", help="step 3: load llama.cpp's files in mbd-rs")
    args = ap.parse_args()
    os.makedirs(WORK, exist_ok=True)
    bad = False
    for name in args.fixtures.split(","):
        lc = os.path.join(WORK, f"{name}.llamacpp.gguf")
        if args.load:
            errs = load(name, lc)
            print(f"{name}: mbd-rs on llama.cpp's file vs transformers, max relative error {max(errs.values()):.2e} "
                  f"over {len(errs)} mask cases")
            bad |= max(errs.values()) > 1e-4
            continue
        lc = convert(name)
        problems, worst, n = compare(lc, ours(name))
        print(f"{name}: {n} tensors; llama.cpp's converter vs scripts/write_gguf.py: "
              + ("the same names, shapes and keys; values within " + f"{worst:.1e}" if not problems
                 else "; ".join(problems)))
        bad |= bool(problems)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
