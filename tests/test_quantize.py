"""Quantized weights (`Engine.load(..., quantize=...)`; docs/quantization.md).

The q8_0 reference below is written from the GGUF block format (blocks of 32 values along a row: d = max|x| / 127
stored as float16, q = round-half-away(x / d) as int8, value = q * d) in numpy, independently of the engine: a
checkpoint whose matrices are replaced by their q8_0 dequantization must give the logits the engine computes from
the original checkpoint with quantize="q8_0". The same holds for q5_0 (q4_k's format for rows that are not whole
256-value super-blocks; its reference below is written from the format the same way). q4_k, q5_k and q6_k are
checked against the unquantized model within a bound (and, stored in GGUF files, against gguf's dequantization of
them in test_gguf.py)."""
import json
import shutil
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mbd_rs
from conftest import parity_dir
from random_checkpoint import random_checkpoint


def q8_0_reference(w: np.ndarray) -> np.ndarray:
    """Dequantized q8_0 of w along its last axis (float32 arithmetic, as the format's reference quantizer)."""
    x = w.astype(np.float32).reshape(-1, 32)
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = (x * inv).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    d16 = d.astype(np.float16).astype(np.float32)
    return (q.astype(np.float32) * d16).reshape(w.shape)


def q5_0_reference(w: np.ndarray) -> np.ndarray:
    """Dequantized q5_0 of w along its last axis: per block of 32, d = (the value of largest magnitude, the first
    such) / -16 stored as float16, q = min(31, floor(x / d + 16.5)) in 5 bits, value = (q - 16) * d (float32)."""
    x = w.astype(np.float32).reshape(-1, 32)
    m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = (m / np.float32(-16)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(31, np.floor((x * inv).astype(np.float32) + np.float32(16.5))).astype(np.int32)
    d16 = d.astype(np.float16).astype(np.float32)
    return ((q - 16).astype(np.float32) * d16).reshape(w.shape)


def quantized_here(name: str, shape) -> bool:
    """Which tensors quantize="q8_0" quantizes: linear layers, the embedding table and the head, rows of whole
    blocks; not the MoE router, norms or biases."""
    table = name in ("model.embed_tokens.weight", "lm_head.weight")
    linear = name.endswith("_proj.weight") or name.endswith("gate_up_proj") or name.endswith("experts.down_proj")
    return (table or linear) and len(shape) >= 2 and shape[-1] % 32 == 0


def is_table(name: str) -> bool:
    return name in ("model.embed_tokens.weight", "lm_head.weight")


def dequantized_twin(src, dst, values=None, linear=q8_0_reference):
    """A copy of checkpoint `src` whose quantized matrices hold their dequantization, in float32: the tables q8_0,
    the linear layers `linear` (`values`: the directory to read the weights from, e.g. the float32 twin of a
    bfloat16 checkpoint: numpy has no bfloat16)."""
    shutil.copytree(src, dst)
    t = load_file((values or src) + "/model.safetensors")
    out = {k: ((q8_0_reference if is_table(k) else linear)(v) if quantized_here(k, v.shape) else v.astype(np.float32))
           for k, v in t.items()}
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name", ["qwen2_gqa_tied", "qwen2_mha_untied", "qwen3_bias_tied", "qwen3moe_top2_norm", "qwen3_bf16"])
def test_q8_0_computes_its_dequantized_checkpoint(tmp_path, name):
    src = parity_dir(name)
    twin = dequantized_twin(src, tmp_path / name, parity_dir(name + "_f32twin") if name == "qwen3_bf16" else None)
    # the exact products (int8_activations=False; the default rounds activations where the CPU has AVX2)
    q = mbd_rs.Engine.load(src, device="cpu", quantize="q8_0", int8_activations=False)
    ref = mbd_rs.Engine.load(twin, device="cpu")
    # held in blocks (few-row windows through the few-row kernel) and the twin held row-major
    qb = mbd_rs.Engine.load(src, device="cpu", quantize="q8_0", int8_activations=False,
                            _kernels=dict(packed_weights=False))
    refb = mbd_rs.Engine.load(twin, device="cpu", _kernels=dict(packed_weights=False))
    # what is held: q8_0, and float32 where a matrix's rows do not split into blocks of 32 (qwen3moe_top2_norm's
    # experts' down_proj: rows of 24)
    t = load_file((parity_dir(name + "_f32twin") if name == "qwen3_bf16" else src) + "/model.safetensors")
    dense = any(not quantized_here(k, v.shape) and (is_table(k) or k.endswith("_proj.weight")) for k, v in t.items())
    assert q.info.weight_format == qb.info.weight_format == ("q8_0+float32" if dense else "q8_0")
    assert q.info.weight_bytes == qb.info.weight_bytes
    ids = list(np.random.default_rng(0).integers(0, q.info.vocab_size, 40))
    for params in [dict(), dict(attention="block_causal", block_size=4, prefix_len=32)]:
        a, b = q.logits(ids, **params), ref.logits(ids, **params)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), params
        # bit for bit where both sum the same way: packed q8_0 (the default on AVX2 CPUs) as its twin's packed f32
        # matrices (every product the in-order chain over k), blocks as the twin's row-major matrices
        assert np.array_equal(a, b), params
        assert np.array_equal(qb.logits(ids, **params), refb.logits(ids, **params)), params
    # a greedy decode through the cache gives the twin's tokens
    a = q.generate(ids[:9], max_tokens=12, block_size=4, early_stop=False)
    b = ref.generate(ids[:9], max_tokens=12, block_size=4, early_stop=False)
    assert a.token_ids == b.token_ids


def test_weight_bytes_count_what_is_held():
    src = parity_dir("qwen3moe_top2_norm")
    t = load_file(src + "/model.safetensors")
    want = sum(v.size // 32 * 34 if quantized_here(k, v.shape) else v.size * 4 for k, v in t.items())
    e = mbd_rs.Engine.load(src, device="cpu", quantize="q8_0")
    assert e.info.weight_bytes == want
    assert mbd_rs.Engine.load(src, device="cpu").info.weight_bytes == sum(v.size * 4 for v in t.values())


def test_k_quants_and_q8_0_stay_close_to_the_unquantized_model(tmp_path):
    d = random_checkpoint(tmp_path / "m")
    base = mbd_rs.Engine.load(d, device="cpu")
    ids = list(np.random.default_rng(1).integers(0, 320, 64))
    ref = base.logits(ids)
    f32_bytes = base.info.weight_bytes
    for fmt, max_rel, min_top1, ratio in [("q8_0", 0.01, 0.95, 34 / 128), ("q4_k", 0.08, 0.9, 144 / 1024),
                                          ("q5_k", 0.04, 0.9, 176 / 1024), ("q6_k", 0.02, 0.95, 210 / 1024),
                                          ("q4_0", 0.08, 0.9, 18 / 128), ("q3_k", 0.15, 0.9, 110 / 1024),
                                          ("q2_k", 0.3, 0.8, 84 / 1024)]:
        e = mbd_rs.Engine.load(d, device="cpu", quantize=fmt)
        got = e.logits(ids)
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        top1 = (got.argmax(1) == ref.argmax(1)).mean()
        assert rel <= max_rel and top1 >= min_top1, (fmt, rel, top1)
        # every matrix is in the format (rows of 256; the tables are q8_0), norms and biases stay f32
        assert e.info.weight_format == (fmt if fmt == "q8_0" else f"{fmt}+q8_0")
        assert e.info.weight_bytes < 1.05 * ratio * f32_bytes + 320 * 256 * (34 / 32 - 4 * ratio) + 20_000


@pytest.mark.parametrize("name", ["qwen2_gqa_tied", "qwen3moe_top2_norm"])
def test_q4_k_falls_back_to_q5_0_for_rows_of_partial_super_blocks(tmp_path, name):
    """The parity models' rows are 64 or 96 values, not whole q4_k super-blocks: under q4_k every linear matrix is
    q5_0 (as llama.cpp's q4_K does) and the tables q8_0, the same as quantize="q5_0", and the engine computes the
    checkpoint whose matrices hold those formats' dequantizations."""
    src = parity_dir(name)
    a = mbd_rs.Engine.load(src, device="cpu", quantize="q4_k", int8_activations=False)
    b = mbd_rs.Engine.load(src, device="cpu", quantize="q5_0", int8_activations=False)
    ref = mbd_rs.Engine.load(dequantized_twin(src, tmp_path / name, linear=q5_0_reference), device="cpu")
    ids = list(range(5, 30))
    assert a.info.weight_bytes == b.info.weight_bytes
    assert np.array_equal(a.logits(ids), b.logits(ids))
    want = ref.logits(ids)
    assert np.abs(a.logits(ids) - want).max() <= 1e-4 * np.abs(want).max()
    # bit for bit: q5_0 (packed at load on AVX2 CPUs) sums as the twin's f32 matrices held alike
    assert np.array_equal(a.logits(ids), want)
    assert np.array_equal(a.logits(ids, attention="block_causal", block_size=4, prefix_len=16),
                          ref.logits(ids, attention="block_causal", block_size=4, prefix_len=16))
    t = load_file(src + "/model.safetensors")
    held = sum((v.size // 32 * (34 if is_table(k) else 22)) if quantized_here(k, v.shape) else v.size * 4
               for k, v in t.items())
    assert a.info.weight_bytes == held


def test_bad_quantize_options_are_clear_errors():
    with pytest.raises(mbd_rs.InvalidRequestError, match="quantize must be 'q8_0', 'q4_k', 'q5_0', 'q5_k', 'q6_k', 'q4_0', 'q3_k' or 'q2_k', got 'int4'"):
        mbd_rs.Engine.load(device="cpu", quantize="int4")
    with pytest.raises(mbd_rs.InvalidRequestError, match="quantize must be"):
        mbd_rs.Engine.load(device="cpu", quantize="Q8_0")  # names are exact, as every string option
    # (on CUDA they load as candle's quantized tensors: benches/gpu/quant.py; other devices are refused with
    # "quantized weights run on the CPU in float32 or on CUDA"; no GPU in CI)


def test_cli_info_and_generate_take_quantize():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "info", "--quantize", "q8_0", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["weight_format"] == "q8_0"
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "generate", "--chat", "sort 3 1 2", "--quantize", "q8_0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "1 2 3\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "info", "--quantize", "q3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "quantize must be" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("fmt,int8", [("q8_0", False), ("q4_k", False), ("q8_0", True), ("q4_k", True)])
def test_quantized_streams_batched_equal_their_lone_runs(fmt, int8):
    # the tiny model under q4_k: q4_k (256-wide rows) and q5_0 (640); int8: their integer dot products
    e = load_int8(None, quantize=fmt) if int8 else mbd_rs.Engine.load(device="cpu", quantize=fmt, int8_activations=False)
    prompts = [f"sort {i} 3 1 {9 - i}" for i in range(6)] + ["reverse abcde", "count a in banana"]
    cfgs = [dict(block_size=4), dict(block_size=1), dict(block_size=8, acceptance="confidence", threshold=0.7)]
    alone = [e.chat([{"role": "user", "content": p}], max_tokens=20, **cfgs[i % 3]).token_ids for i, p in enumerate(prompts)]
    got = [None] * len(prompts)

    def run(i):
        got[i] = e.chat([{"role": "user", "content": prompts[i]}], max_tokens=20, **cfgs[i % 3]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert e.batch_stats[1] > e.batch_stats[0]  # some forwards carried several streams


def test_quantized_tiny_model_still_solves_its_tasks():
    plain = mbd_rs.Engine.load(device="cpu")
    q = mbd_rs.Engine.load(device="cpu", quantize="q8_0")
    assert q.info.weight_bytes < 0.6 * plain.info.weight_bytes
    for p, want in [("sort 5 2 9 1", "1 2 5 9"), ("reverse h e l l o", "o l l e h"), ("repeat ab 3", "ab ab ab")]:
        assert q.chat([{"role": "user", "content": p}], max_tokens=24).text == want, p
        assert plain.chat([{"role": "user", "content": p}], max_tokens=24).text == want, p


def load_int8(path, **kw):
    """Engine.load(path, device="cpu", int8_activations=True, **kw), or a skip where the CPU lacks AVX2 (the load
    refuses the option there, with that reason)."""
    try:
        return mbd_rs.Engine.load(path, device="cpu", int8_activations=True, **kw)
    except mbd_rs.InvalidRequestError as e:
        if "lacks AVX2" in str(e):
            pytest.skip(str(e))
        raise


def test_int8_activations_stay_close_to_float_activations(tmp_path):
    """int8_activations rounds each activation row to 8 bits per block of 32 before the quantized products: the
    logits move by about the rounding (a fraction of a percent), not more, and do move (the option is in effect).
    (The products themselves are checked in Rust against a float64 reference on the rounded activations.)"""
    d = random_checkpoint(tmp_path / "m")
    ids = list(np.random.default_rng(2).integers(0, 320, 64))
    for fmt in ["q8_0", "q6_k", "q5_k", "q4_k", "q5_0", "q4_0"]:
        f = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=False)
        i = load_int8(d, quantize=fmt)
        assert (i.info.int8_activations, f.info.int8_activations) == (True, False)
        assert i.info.weight_format == f.info.weight_format == (fmt if fmt == "q8_0" else f"{fmt}+q8_0")
        assert i.info.weight_bytes == f.info.weight_bytes
        want, got = f.logits(ids), i.logits(ids)
        rel = np.abs(got - want).max() / np.abs(want).max()
        top1 = (got.argmax(1) == want.argmax(1)).mean()
        assert 0 < rel <= 0.03 and top1 >= 0.95, (fmt, rel, top1)
        # a shorter window gives the same rows: a row does not depend on the other rows of its products
        assert np.array_equal(i.logits(ids[:40]), got[:40])
        # AVX2's kernels (packed_avx512=False) give AVX-512 VNNI's bits
        assert np.array_equal(load_int8(d, quantize=fmt, _kernels=dict(packed_avx512=False)).logits(ids), got)


def test_int8_activations_are_the_default_where_the_cpu_has_them(tmp_path):
    """int8_activations=None (the default) rounds the activations wherever it can (a CPU with AVX2, in float32) and
    otherwise keeps the exact products: the default's logits are bit for bit the explicit choice's, and
    `info.int8_activations` says which it was. A model with nothing quantized reports False either way."""
    d = random_checkpoint(tmp_path / "m")
    ids = list(np.random.default_rng(4).integers(0, 320, 24))
    for fmt in ["q8_0", "q4_k"]:
        default = mbd_rs.Engine.load(d, device="cpu", quantize=fmt)
        exact = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=False)
        try:
            chosen = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=True)
        except mbd_rs.InvalidRequestError as e:
            assert "lacks AVX2" in str(e)
            chosen = exact
        assert (default.info.int8_activations, exact.info.int8_activations) == (chosen is not exact, False)
        assert np.array_equal(default.logits(ids), chosen.logits(ids)), fmt
        if chosen is not exact:
            assert not np.array_equal(default.logits(ids), exact.logits(ids)), fmt
    for kw in [dict(), dict(int8_activations=False)]:
        assert mbd_rs.Engine.load(d, device="cpu", **kw).info.int8_activations is False


def test_int8_activations_errors_are_clear():
    with pytest.raises(mbd_rs.InvalidRequestError, match="int8_activations=True: it multiplies quantized matrices"):
        mbd_rs.Engine.load(device="cpu", int8_activations=True)


def test_int8_tiny_model_still_solves_its_tasks():
    e = load_int8(None, quantize="q8_0")
    for p, want in [("sort 5 2 9 1", "1 2 5 9"), ("reverse h e l l o", "o l l e h"), ("repeat ab 3", "ab ab ab")]:
        assert e.chat([{"role": "user", "content": p}], max_tokens=24).text == want, p


def test_cli_takes_int8_activations():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "info", "--quantize", "q8_0", "--int8-activations", "--json"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "lacks AVX2" in r.stderr:
        pytest.skip("this CPU lacks AVX2")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["weight_format"], info["int8_activations"]) == ("q8_0", True)
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "info", "--quantize", "q8_0", "--no-int8-activations", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["int8_activations"] is False, r.stderr
    r = subprocess.run([sys.executable, "-m", "mbd_rs", "info", "--int8-activations"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "it multiplies quantized matrices" in r.stderr and "Traceback" not in r.stderr


def test_candle_quantized_tensors_stay_close(tmp_path):
    """CUDA holds quantized linear layers as candle's quantized tensors and multiplies them with candle's quantized
    matmul (`Matrix::Candle`; its kernels round the activations to 8 bits). The same path on the CPU
    (_kernels=dict(candle_quant=True)) computes the same model: logits within the activations' rounding of the
    exact path, the same bytes held. (On a GPU: benches/gpu.)"""
    d = random_checkpoint(tmp_path / "m")
    ids = list(np.random.default_rng(3).integers(0, 320, 48))
    for fmt in ["q8_0", "q6_k", "q4_k", "q4_0"]:
        f = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=False)
        # the tables (embedding, head) as on CUDA: not candle's, here the CPU's exact products
        c = mbd_rs.Engine.load(d, device="cpu", quantize=fmt, int8_activations=False, _kernels=dict(candle_quant=True))
        assert c.info.weight_bytes == f.info.weight_bytes and c.info.weight_format == f.info.weight_format
        want, got = f.logits(ids), c.logits(ids)
        rel = np.abs(got - want).max() / np.abs(want).max()
        top1 = (got.argmax(1) == want.argmax(1)).mean()
        assert 0 < rel <= 0.03 and top1 >= 0.95, (fmt, rel, top1)


def test_values_a_format_cannot_hold_are_refused_at_load_naming_the_tensor(tmp_path):
    """Weights near 1e7 are a valid float checkpoint (it loads and computes), but q8_0's f16 block scale (max|w| / 127)
    overflows above about 8.3e6: quantize="q8_0" is refused at load with an error that names the tensor and the
    format and says the checkpoint is fine (before: the load succeeded and the first forward raised "its weights or
    config.json are broken")."""
    d = random_checkpoint(tmp_path / "m")
    p = str(d / "model.safetensors")
    t = load_file(p)
    name = "model.layers.1.mlp.up_proj.weight"
    t[name][7, :] *= 1.2e7 / np.abs(t[name][7, :]).max()
    save_file(t, p)
    f = mbd_rs.Engine.load(d, device="cpu")
    assert np.isfinite(f.logits([5, 6, 7])).all()
    for fmt in ("q8_0", "q5_0"):
        with pytest.raises(mbd_rs.InvalidRequestError) as ei:
            mbd_rs.Engine.load(d, device="cpu", quantize=fmt)
        msg = str(ei.value)
        for needle in (f"tensor '{name}'", f"cannot be held as {fmt}", "row 7", "1.2e7", f"without quantize='{fmt}'"):
            assert needle in msg, (needle, msg)
    # a format whose scales reach that far holds it (q6_k: 8-bit sub-scales times an f16 super-block scale)
    q = mbd_rs.Engine.load(d, device="cpu", quantize="q6_k")
    assert np.isfinite(q.logits([5, 6, 7])).all()


def test_weight_format_names_what_is_held(tmp_path):
    """`info.weight_format` is derived from what is held: the block formats (sorted), then the dtypes of the matrices
    left unquantized, joined by "+". Before, it named the requested format: "q4_k" when every matrix fell back to
    q5_0, and when nothing was quantized at all."""
    d = random_checkpoint(tmp_path / "m")  # rows of 256 and 512: whole q4_k super-blocks; the tables are q8_0
    assert mbd_rs.Engine.load(d, device="cpu").info.weight_format == "float32"
    assert mbd_rs.Engine.load(d, device="cpu", quantize="q8_0").info.weight_format == "q8_0"
    assert mbd_rs.Engine.load(d, device="cpu", quantize="q4_k").info.weight_format == "q4_k+q8_0"
    # rows of 64 and 96 values: under q4_k every linear matrix falls back to q5_0
    e = mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), device="cpu", quantize="q4_k")
    assert e.info.weight_format == "q5_0+q8_0" and e.info.warnings == []
    assert mbd_rs.Engine.load(parity_dir("qwen3_bf16"), device="cpu").info.weight_format == "bfloat16"


def test_quantize_that_quantizes_nothing_is_warned_about(tmp_path):
    """A checkpoint whose rows (48 and 72 values) split into no format's blocks: quantize="q4_k" quantizes nothing.
    The format says so ("float32", not "q4_k"), and the load warns."""
    d = random_checkpoint(tmp_path / "m", hidden=48, inter=72, head_dim=12)
    with pytest.warns(UserWarning, match=r"quantize='q4_k' quantized no matrix: the weights are held as float32"):
        e = mbd_rs.Engine.load(d, device="cpu", quantize="q4_k")
    assert e.info.weight_format == "float32" and e.info.weight_bytes == mbd_rs.Engine.load(d).info.weight_bytes
    assert len(e.info.warnings) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mbd_rs.Engine.load(d, device="cpu").info.warnings == []
