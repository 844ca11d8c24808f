"""GGUF files (llama.cpp's single-file format) load as models: `Engine.load("model.gguf")`.

The files are written here with llama.cpp's own Python package (`gguf`, the writer its converter uses; tensor names
from its `TensorNameMap`), never by this engine. Expected values come from elsewhere:
(a) float GGUFs of the parity fixtures give transformers' recorded logits (tests/fixtures/parity/*/expected.npz);
(b) block formats the kernel multiplies (q8_0, q5_0, q4_0 written by gguf's quantizer, q2_k to q6_k as random blocks) compute
    exactly what the same model does from an f32 safetensors checkpoint holding gguf's own dequantization of
    those blocks (bit for bit: a quantized matrix computes as its dequantized f32 matrix);
(c) block formats it lacks (q4_1, q5_1) are held as q8_0: the same logits as that
    dequantized checkpoint loaded with quantize="q8_0";
(d) the tokenizer built from the GGUF's vocabulary encodes as the `tokenizers` library does with the fixture's
    tokenizer.json, and, for Qwen2's real vocabulary GGUF, as llama.cpp's golden vectors say;
(e) broken or hostile files raise a specific error, never crash the process.
"""
import importlib.util
import os
import random
import shutil

import numpy as np
import pytest

import mbd_rs
from conftest import HERE, load_cases, parity_dir

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

META = load_cases()
CASES = META["cases"]


pytestmark = pytest.mark.source_tree  # scripts/write_gguf.py writes the files
SCRIPT = os.path.join(HERE, "..", "scripts", "write_gguf.py")
if not os.path.exists(SCRIPT):
    pytest.skip("needs the repository's scripts/write_gguf.py", allow_module_level=True)


def _writer():
    spec = importlib.util.spec_from_file_location("write_gguf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = _writer()
read_hf, write_gguf, write_dir, CHATML = W.read_hf, W.write_gguf, W.write_dir, W.CHATML


# --- (a) float files of the parity fixtures give transformers' logits --------------------------------------------

@pytest.mark.parametrize("name", META["fixtures"])
def test_float_gguf_matches_transformers(tmp_path, name):
    src = parity_dir(name)
    cfg, tensors = read_hf(src)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(path, cfg, tensors, src)
    eng = mbd_rs.Engine.load(path, device="cpu")
    ref = mbd_rs.Engine.load(src, device="cpu")
    exp = np.load(os.path.join(src, "expected.npz"))
    assert eng.info.vocab_size == ref.info.vocab_size and eng.info.num_parameters == ref.info.num_parameters
    assert eng.info.weight_format == "float32"
    for case, c in CASES.items():
        kw = dict(attention=c["attention"], block_size=c["block_size"], alignment=c["alignment"],
                  prompt_len=c["prompt_len"])
        got = eng.logits(exp["ids"], **kw)
        err = float(np.abs(got - exp[case]).max() / np.abs(exp[case]).max())
        assert err <= 1e-4, (name, case, err)
        # the same numbers as the safetensors checkpoint, bit for bit
        assert np.array_equal(got, ref.logits(exp["ids"], **kw)), (name, case)


def test_f16_gguf_computes_its_f16_values(tmp_path):
    src = parity_dir("qwen3_headdim_gqa")
    cfg, tensors = read_hf(src)
    half = {k: v.astype(np.float16) for k, v in tensors.items()}
    write_gguf(str(tmp_path / "m.gguf"), cfg, half, src)
    write_dir(str(tmp_path / "dir"), src, cfg, {k: v.astype(np.float32) for k, v in half.items()})
    a = mbd_rs.Engine.load(str(tmp_path / "m.gguf"), device="cpu")
    b = mbd_rs.Engine.load(str(tmp_path / "dir"), device="cpu")
    ids = list(range(5, 45))
    assert np.array_equal(a.logits(ids, attention="causal"), b.logits(ids, attention="causal"))


# --- (b), (c) block formats ----------------------------------------------------------------------------------------

def random_blocks(rng, qtype, shape):
    """Random blocks of a k-quant type with small finite f16 scales (gguf has no k-quant quantizer)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n, k = shape
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)

    def f16(v):
        return np.full((n, k // bs), v, dtype=np.float16).view(np.uint8).reshape(n, k // bs, 2)

    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K):  # d, dmin first (q2_k: after the scales and quants)
        at = 0 if qtype != Q.Q2_K else ts - 4
        raw[:, :, at:at + 2] = f16(3e-4)
        raw[:, :, at + 2:at + 4] = f16(2e-4)
    elif qtype in (Q.Q6_K, Q.Q3_K):  # d last
        raw[:, :, ts - 2:] = f16(1e-4 if qtype == Q.Q6_K else 2e-3)
    return raw.reshape(n, k // bs * ts)


def block_model(tmp_path, formats):
    """A random Qwen3 model with rows of 256 and 512 values (whole k-quant super-blocks), its matrices encoded
    by `formats(name)`; returns (gguf path, dir of gguf's dequantization as f32)."""
    rng = np.random.default_rng(7)
    src = parity_dir("qwen3_headdim_gqa")
    cfg, small = read_hf(src)
    h, ff, heads, kv, d, vocab = 256, 512, 4, 2, 64, small["model.embed_tokens.weight"].shape[0]
    cfg = dict(cfg, hidden_size=h, intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=d, num_hidden_layers=2, tie_word_embeddings=False, vocab_size=vocab)
    t = {"model.embed_tokens.weight": rng.normal(0, 1, (vocab, h)), "lm_head.weight": rng.normal(0, 0.05, (vocab, h)),
         "model.norm.weight": 1 + 0.1 * rng.normal(size=h)}
    for i in range(2):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": 1 + 0.1 * rng.normal(size=h),
                  f"{p}.post_attention_layernorm.weight": 1 + 0.1 * rng.normal(size=h),
                  f"{p}.self_attn.q_norm.weight": 1 + 0.1 * rng.normal(size=d),
                  f"{p}.self_attn.k_norm.weight": 1 + 0.1 * rng.normal(size=d),
                  f"{p}.self_attn.q_proj.weight": rng.normal(0, 0.05, (heads * d, h)),
                  f"{p}.self_attn.k_proj.weight": rng.normal(0, 0.05, (kv * d, h)),
                  f"{p}.self_attn.v_proj.weight": rng.normal(0, 0.05, (kv * d, h)),
                  f"{p}.self_attn.o_proj.weight": rng.normal(0, 0.05, (h, heads * d)),
                  f"{p}.mlp.gate_proj.weight": rng.normal(0, 0.05, (ff, h)),
                  f"{p}.mlp.up_proj.weight": rng.normal(0, 0.05, (ff, h)),
                  f"{p}.mlp.down_proj.weight": rng.normal(0, 0.05, (h, ff))})
    t = {k: v.astype(np.float32) for k, v in t.items()}
    deq = dict(t)

    def encode(name, arr):
        qtype = formats(name) if arr.ndim == 2 else None
        if qtype is None:
            return None
        if qtype in (Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q5_1, Q.Q4_1):
            raw = gguf.quants.quantize(arr, qtype)
        else:
            raw = random_blocks(rng, qtype, arr.shape)
        deq[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(arr.shape)
        return raw, qtype

    path = str(tmp_path / "blocks.gguf")
    write_gguf(path, cfg, t, src, encode)
    write_dir(str(tmp_path / "deq"), src, cfg, deq)
    return path, str(tmp_path / "deq")


def native_formats(name):
    for part, q in (("q_proj", Q.Q4_K), ("k_proj", Q.Q8_0), ("v_proj", Q.Q6_K), ("o_proj", Q.Q5_K),
                    ("gate_proj", Q.Q4_K), ("up_proj", Q.Q5_0), ("down_proj", Q.Q6_K), ("embed", Q.Q8_0),
                    ("lm_head", Q.Q6_K)):
        if part in name:
            return q
    return None


def low_bit_formats(name):  # llama.cpp's Q4_0, Q3_K_* and Q2_K files
    for part, q in (("q_proj", Q.Q3_K), ("k_proj", Q.Q4_0), ("v_proj", Q.Q2_K), ("o_proj", Q.Q2_K),
                    ("gate_proj", Q.Q3_K), ("up_proj", Q.Q2_K), ("down_proj", Q.Q3_K), ("embed", Q.Q4_0),
                    ("lm_head", Q.Q3_K)):
        if part in name:
            return q
    return None


def packed_formats(name):  # formats of both kinds of record (one f16 scale per block; k-quant super-blocks)
    for part, q in (("q_proj", Q.Q4_K), ("k_proj", Q.Q8_0), ("v_proj", Q.Q4_0), ("o_proj", Q.Q6_K),
                    ("gate_proj", Q.Q5_K), ("up_proj", Q.Q4_K), ("down_proj", Q.Q6_K), ("embed", Q.Q8_0),
                    ("lm_head", Q.Q5_0)):
        if part in name:
            return q
    return None


def other_formats(name):
    for part, q in (("q_proj", Q.Q4_1), ("k_proj", Q.Q5_1), ("v_proj", Q.Q5_1), ("o_proj", Q.Q4_1),
                    ("gate_proj", Q.Q5_1), ("up_proj", Q.Q4_1), ("down_proj", Q.Q5_1), ("embed", Q.Q4_1),
                    ("lm_head", Q.Q5_1)):
        if part in name:
            return q
    return None


IDS = [(7 * i + 3) % 300 + 5 for i in range(80)]


@pytest.mark.parametrize("formats,held,share,packed", [(native_formats, "q4_k+q5_0+q5_k+q6_k+q8_0", 0.4, False),
                                                        (low_bit_formats, "q2_k+q3_k+q4_0", 0.15, False),
                                                        (packed_formats, "q4_0+q4_k+q5_0+q5_k+q6_k+q8_0", 0.4, True),
                                                        (low_bit_formats, "q2_k+q3_k+q4_0", 0.15, True)])
def test_native_block_formats_compute_their_dequantization(tmp_path, formats, held, share, packed):
    path, deq = block_model(tmp_path, formats)
    # held in their blocks (`packed`: False), against the dequantized checkpoint's f32 matrices held row-major, as
    # the quantized kernel reads its blocks; or packed at load (the default on AVX2 CPUs)
    # against the f32 matrices packed (every product the in-order chain over k, a different rounding from the
    # row-major one). Without the packed product both engines hold row-major matrices.
    kernels = {} if packed else dict(packed_weights=False)
    a = mbd_rs.Engine.load(path, device="cpu", int8_activations=False, _kernels=kernels)
    b = mbd_rs.Engine.load(deq, device="cpu", _kernels=kernels)
    assert a.info.weight_format == held
    assert a.info.weight_bytes < share * b.info.weight_bytes
    for n, prefix in ((1, 0), (3, 8), (8, 16), (80, 0), (20, 60)):  # few-row kernel and long windows
        ids = IDS[: prefix + n]
        la = a.logits(ids, attention="causal", prefix_len=prefix)
        lb = b.logits(ids, attention="causal", prefix_len=prefix)
        assert np.array_equal(la, lb), (n, prefix, float(np.abs(la - lb).max()))
    assert np.abs(la).max() > 0.1  # not a vacuous comparison


def test_other_block_formats_are_held_as_q8_0(tmp_path):
    path, deq = block_model(tmp_path, other_formats)
    a = mbd_rs.Engine.load(path, device="cpu")
    b = mbd_rs.Engine.load(deq, device="cpu", quantize="q8_0")
    f = mbd_rs.Engine.load(deq, device="cpu")
    assert a.info.weight_format == "q8_0"
    for n in (4, 80):
        la = a.logits(IDS[:n], attention="causal")
        assert np.array_equal(la, b.logits(IDS[:n], attention="causal"))
        lf = f.logits(IDS[:n], attention="causal")
        assert float(np.abs(la - lf).max() / np.abs(lf).max()) < 0.05  # close to the k-quants' own values


# --- (d) tokenizer and chat template ----------------------------------------------------------------------------

TEXTS = ["hello world", "  two  spaces\nand a newline", "Grün ёж 世界 🦙", "1234 + 5678 = ?", "", "a<|x|>b"]


def test_tokenizer_matches_tokenizers_library(tmp_path):
    from tokenizers import Tokenizer
    src = parity_dir("qwen2_gqa_tied")
    cfg, tensors = read_hf(src)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, cfg, tensors, src)
    eng = mbd_rs.Engine.load(path, device="cpu")
    ref = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert eng.tokenize(text, add_special_tokens=False) == ids, text
        assert eng.detokenize(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    # the GGUF's chat template and end-of-sequence id
    prompt = eng.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert eng.info.eos_token_ids == [0]
    assert eng.info.chat_template == CHATML
    if importlib.util.find_spec("starlette") is not None:  # the server's /tokenizer_info reports it too
        from mbd_rs.server.openai import tokenizer_info as _tokenizer_info
        info = _tokenizer_info(eng)
        assert info["chat_template"] == CHATML and info["eos_token_ids"] == [0]
    out = eng.generate("hello", max_tokens=6, block_size=1)
    assert out.usage.completion_tokens >= 1


def test_block_diffusion_profile_from_overrides(tmp_path):
    """A GGUF has no block-diffusion fields: the overrides make it one, as they do for the same directory."""
    src = parity_dir("qwen3_headdim_gqa")
    cfg, tensors = read_hf(src)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, cfg, tensors, src)
    ov = dict(block_size=4, attention="block_causal", logits_shift=False, mask_token_id=3, eos_token_ids=[0])
    a = mbd_rs.Engine.load(path, device="cpu", **ov)
    b = mbd_rs.Engine.load(src, device="cpu", **ov)
    assert (a.info.block_size, a.info.attention, a.info.logits_shift) == (4, "block_causal", False)
    for params in (dict(threshold=0.5), dict(block_add_threshold=0.25, threshold=0.9)):
        ga = a.generate([5, 9, 11, 2], max_tokens=12, early_stop=False, **params)
        gb = b.generate([5, 9, 11, 2], max_tokens=12, early_stop=False, **params)
        assert ga.token_ids == gb.token_ids and ga.usage.forward_passes == gb.usage.forward_passes


def test_qwen2_vocabulary_gguf_golden_vectors(tmp_path):
    """Qwen2's real vocabulary GGUF (llama.cpp's tokenizer-test file) with small random weights: tokenization equals
    llama.cpp's golden vectors."""
    sdist = os.environ.get("MBD_LLAMACPP_SDIST")
    if not sdist or not os.path.exists(sdist):
        pytest.skip("$MBD_LLAMACPP_SDIST (llama-cpp-python's sdist, downloaded by scripts/test.sh) is not there")
    from test_qwen_vocab import _script, read_golden
    files = _script().extract_vocab(sdist, str(tmp_path / "vocab"))
    r = gguf.GGUFReader(files["ggml-vocab-qwen2.gguf"])
    tok = {k: r.fields[k].contents() for k in r.fields if k.startswith("tokenizer.")}
    vocab = len(tok["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)
    h = 32
    cfg = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 1, "max_position_embeddings": 512,
           "hidden_size": h, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    p = "model.layers.0"
    t = {"model.embed_tokens.weight": rng.normal(0, 1, (vocab, h)).astype(np.float16),
         "model.norm.weight": np.ones(h, np.float32)}
    for n, s in (("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
                 ("self_attn.q_proj.weight", (h, h)), ("self_attn.q_proj.bias", (h,)),
                 ("self_attn.k_proj.weight", (h, h)), ("self_attn.k_proj.bias", (h,)),
                 ("self_attn.v_proj.weight", (h, h)), ("self_attn.v_proj.bias", (h,)),
                 ("self_attn.o_proj.weight", (h, h)), ("mlp.gate_proj.weight", (64, h)),
                 ("mlp.up_proj.weight", (64, h)), ("mlp.down_proj.weight", (h, 64))):
        t[f"{p}.{n}"] = rng.normal(0, 0.05, s).astype(np.float32)
    path = str(tmp_path / "qwen2-vocab.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(list(tok["tokenizer.ggml.tokens"]))
    w.add_token_types([int(x) for x in tok["tokenizer.ggml.token_type"]])
    w.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 1)
    for n, arr in t.items():
        w.add_tensor(tmap.get_name(n, try_suffixes=(".weight", ".bias")), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    eng = mbd_rs.Engine.load(path, device="cpu")
    cases = read_golden(files["ggml-vocab-qwen2.gguf.inp"], files["ggml-vocab-qwen2.gguf.out"])
    assert len(cases) > 20
    for text, ids in cases:
        assert eng.tokenize(text, add_special_tokens=False) == ids, text
    assert eng.tokenize("<|im_start|>", add_special_tokens=False) == [tok["tokenizer.ggml.tokens"].index("<|im_start|>")]


# --- (e) broken and hostile files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    src = parity_dir("qwen2_gqa_tied")
    cfg, tensors = read_hf(src)
    path = str(tmp_path_factory.mktemp("gguf") / "good.gguf")
    write_gguf(path, cfg, tensors, src)
    with open(path, "rb") as f:
        return f.read()


def load_bytes(tmp_path, data, name="x.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return mbd_rs.Engine.load(str(p), device="cpu")


def test_broken_files_name_the_problem(tmp_path, good_file):
    import struct
    with pytest.raises(mbd_rs.ModelLoadError, match="not a GGUF file"):
        load_bytes(tmp_path, b"GGUF" + b"\0" * 8)
    with pytest.raises(mbd_rs.ModelLoadError, match="not a GGUF file|not a safetensors"):
        load_bytes(tmp_path, b"XXXX" + good_file[4:])
    with pytest.raises(mbd_rs.ModelLoadError, match="GGUF version 1"):
        load_bytes(tmp_path, good_file[:4] + struct.pack("<I", 1) + good_file[8:])
    with pytest.raises(mbd_rs.ModelLoadError, match="big-endian"):
        load_bytes(tmp_path, good_file[:4] + struct.pack(">I", 3) + good_file[8:])
    with pytest.raises(mbd_rs.ModelLoadError, match="tensor count"):
        load_bytes(tmp_path, good_file[:8] + struct.pack("<Q", 1 << 40) + good_file[16:])
    for cut in (30, len(good_file) // 3, len(good_file) - 10):
        with pytest.raises(mbd_rs.ModelLoadError):
            load_bytes(tmp_path, good_file[:cut])


def test_unsupported_contents_are_named(tmp_path):
    src = parity_dir("qwen2_gqa_tied")
    cfg, tensors = read_hf(src)
    p = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(mbd_rs.UnsupportedArchitectureError, match="GGUF architecture 'llama'"):
        mbd_rs.Engine.load(p, device="cpu")
    # an extra tensor the model does not have
    p = str(tmp_path / "extra.gguf")
    write_gguf(p, cfg, tensors, src, raw_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(mbd_rs.UnsupportedArchitectureError, match="tensor 'rope_freqs.weight' is not one"):
        mbd_rs.Engine.load(p, device="cpu")
    # a missing dimension key
    p = str(tmp_path / "nokey.gguf")
    write_gguf(p, cfg, tensors, src)
    raw = open(p, "rb").read().replace(b"qwen2.embedding_length", b"qwen2.embedding_lengtX")
    with pytest.raises(mbd_rs.ConfigError, match="qwen2.embedding_length' is missing"):
        load_bytes(tmp_path, raw)


def test_non_finite_block_scale_is_refused(tmp_path):
    def formats(name):
        return Q.Q8_0 if "k_proj" in name else None
    path, _ = block_model(tmp_path, formats)
    raw = bytearray(open(path, "rb").read())
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == "blk.1.attn_k.weight")
    raw[t.data_offset + 34 * 5: t.data_offset + 34 * 5 + 2] = np.array([np.inf], np.float16).tobytes()
    with pytest.raises(mbd_rs.ModelLoadError, match="blk.1.attn_k|k_proj.*non-finite scale"):
        load_bytes(tmp_path, bytes(raw))


def test_fuzzed_headers_never_crash(tmp_path, good_file):
    """Random corruptions of the header (and a few of the data): each load succeeds or raises an MbdError."""
    rng = random.Random(1)
    header_end = good_file.index(b"blk.0.attn_norm.weight") + 200
    outcomes = {"ok": 0, "error": 0}
    for i in range(150):
        data = bytearray(good_file)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(header_end) if rng.random() < 0.9 else rng.randrange(len(data))
            data[at] = rng.randrange(256)
        try:
            load_bytes(tmp_path, bytes(data), f"f{i}.gguf")
            outcomes["ok"] += 1
        except mbd_rs.MbdError:
            outcomes["error"] += 1
    assert outcomes["error"] > 30, outcomes
