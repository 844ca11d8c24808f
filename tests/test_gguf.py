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
import json
import os
import random

import numpy as np
import pytest

import mbd_rs
from conftest import HERE, load_cases, parity_dir, run_child

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

META = load_cases()
GGUF_FIXTURES = META["fixtures"]  # Qwen3.5's written as llama.cpp's converter writes qwen35 / qwen35moe files
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


def gguf_of(src, path, **cfg_edits):
    """The model directory `src` written as a GGUF file at `path` (its config edited by `cfg_edits`); the path."""
    cfg, tensors = read_hf(src)
    write_gguf(str(path), dict(cfg, **cfg_edits), tensors, src)
    return str(path)


# --- (a) float files of the parity fixtures give transformers' logits --------------------------------------------

@pytest.mark.parametrize("name", GGUF_FIXTURES)
def test_float_gguf_matches_transformers(tmp_path, name):
    src = parity_dir(name)
    path = gguf_of(src, tmp_path / f"{name}.gguf")
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
        # the same numbers as the safetensors checkpoint, bit for bit (Qwen3.5's file holds other values: its norms
        # with the 1 added, -exp(A_log), value heads reordered, so only within rounding)
        if not name.startswith("qwen35"):
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
    path = gguf_of(src, tmp_path / "m.gguf")
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
    path = gguf_of(src, tmp_path / "m.gguf")
    ov = dict(block_size=4, attention="block_causal", logits_shift=False, mask_token_id=3, eos_token_ids=[0])
    a = mbd_rs.Engine.load(path, device="cpu", **ov)
    b = mbd_rs.Engine.load(src, device="cpu", **ov)
    assert (a.info.block_size, a.info.attention, a.info.logits_shift) == (4, "block_causal", False)
    for params in (dict(threshold=0.5), dict(block_add_threshold=0.25, threshold=0.9)):
        ga = a.generate([5, 9, 11, 2], max_tokens=12, early_stop=False, **params)
        gb = b.generate([5, 9, 11, 2], max_tokens=12, early_stop=False, **params)
        assert ga.token_ids == gb.token_ids and ga.usage.forward_passes == gb.usage.forward_passes


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_qwen_vocabulary_gguf_golden_vectors(tmp_path, pre):
    """Qwen2's and Qwen3.5's real vocabulary GGUFs (llama.cpp's tokenizer-test files; pre-tokenizers `qwen2` and
    `qwen35`) with small random weights: tokenization equals llama.cpp's golden vectors."""
    sdist = os.environ.get("MBD_LLAMACPP_SDIST")
    if not sdist or not os.path.exists(sdist):
        pytest.skip("$MBD_LLAMACPP_SDIST (llama-cpp-python's sdist, downloaded by scripts/test.sh) is not there")
    from test_qwen_vocab import _script, read_golden
    name = f"ggml-vocab-{pre}.gguf"
    script = _script()
    files = script.extract_vocab(sdist, str(tmp_path / "vocab"), name)
    tok = script.tokenizer_fields(files[name])
    vocab = len(tok["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)
    h = 32
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
    assert tok["tokenizer.ggml.pre"] == pre
    cases = read_golden(files[name + ".inp"], files[name + ".out"])
    assert len(cases) > 20
    for text, ids in cases:
        assert eng.tokenize(text, add_special_tokens=False) == ids, text
    assert eng.tokenize("<|im_start|>", add_special_tokens=False) == [tok["tokenizer.ggml.tokens"].index("<|im_start|>")]


# every file the writer makes: the parity fixtures (f32 and bf16) and the embedded model (bf16, its character
# vocabulary respelled as a byte-level BPE)
TWINS = GGUF_FIXTURES + ["qwen3_bf16", "mbd-tiny"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 5 3 9 1\nthen add 12+30"},
        {"role": "assistant", "content": "1 3 5 9, 42"}, {"role": "user", "content": "thanks <3"}]


def _twin(name):
    return mbd_rs.DEFAULT_MODEL if name == "mbd-tiny" else parity_dir(name)


@pytest.mark.parametrize("name", TWINS)
def test_control_tokens_mask_and_chat_prompt_match_the_directory(tmp_path, name):
    """Every control token at its own id: a GGUF's tokenizer encodes and decodes the control tokens, finds the mask
    token and tokenizes a rendered chat prompt as its safetensors twin does (before, tokens that are not in the BPE
    vocabulary were numbered after it: `<|im_start|>` 309 instead of 1, the mask 311 instead of 3)."""
    src = _twin(name)
    path = gguf_of(src, tmp_path / f"{name}.gguf")
    g = mbd_rs.Engine.load(path, device="cpu")
    d = mbd_rs.Engine.load(src, device="cpu")
    with open(os.path.join(src, "tokenizer.json")) as f:
        added = json.load(f)["added_tokens"]
    assert [a["content"] for a in added] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    for a in added:
        assert g.tokenize(a["content"], add_special_tokens=False) == [a["id"]], a
        assert d.tokenize(a["content"], add_special_tokens=False) == [a["id"]], a
        assert g.detokenize([a["id"]], skip_special_tokens=False) == a["content"]
    assert g.info.mask_token_id == d.info.mask_token_id == 3
    prompt = g.apply_chat_template(CHAT)
    if d.info.chat_template is not None:
        assert d.apply_chat_template(CHAT) == prompt
    ids = d.tokenize(prompt, add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4, ids  # <|im_start|> and <|im_end|> as themselves
    assert g.tokenize(prompt, add_special_tokens=False) == ids
    for skip in (False, True):
        assert g.detokenize(ids, skip_special_tokens=skip) == d.detokenize(ids, skip_special_tokens=skip)
    assert g.detokenize(ids, skip_special_tokens=False) == prompt
    # a chat request sends those prompt ids
    assert g.chat(CHAT, max_tokens=1).usage.prompt_tokens == len(ids)
    if d.info.chat_template is not None:
        assert d.chat(CHAT, max_tokens=1).usage.prompt_tokens == len(ids)


# --- (e) broken and hostile files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = gguf_of(parity_dir("qwen2_gqa_tied"), tmp_path_factory.mktemp("gguf") / "good.gguf")
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


# --- (e) Qwen3.5 (qwen35, qwen35moe): llama.cpp's conventions --------------------------------------------------

def test_qwen35_gguf_conventions_are_read(tmp_path):
    """The file holds what llama.cpp's converter writes (value heads in tiled order, norms with their 1 added,
    -exp(A_log), the convolution squeezed): checked in the file here, so that the parity above proves the loader
    undoes each of them; a q8_0 file computes close to the directory quantized to q8_0."""
    src = parity_dir("qwen35_hybrid")
    cfg, tensors = read_hf(src)
    path = gguf_of(src, tmp_path / "h.gguf")
    r = gguf.GGUFReader(path)
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    hk, hv, dv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    z = tensors["model.layers.0.linear_attn.in_proj_z.weight"].reshape(hk, hv // hk, dv, -1)
    assert np.array_equal(t["blk.0.attn_gate.weight"].reshape(hv // hk, hk, dv, -1), z.swapaxes(0, 1))
    assert np.allclose(t["blk.0.attn_norm.weight"], tensors["model.layers.0.input_layernorm.weight"] + 1)
    assert np.allclose(t["blk.0.ssm_norm.weight"], tensors["model.layers.0.linear_attn.norm.weight"])
    a_log = tensors["model.layers.0.linear_attn.A_log"].reshape(hk, hv // hk).T.reshape(-1)
    assert np.allclose(t["blk.0.ssm_a"], -np.exp(a_log))
    assert t["blk.0.ssm_conv1d.weight"].ndim == 2
    # q8_0 blocks compute their dequantized values: the same file with each block-format matrix replaced by its
    # dequantization (float32), both held row-major
    def q8(name, a):
        return (gguf.quants.quantize(a.astype(np.float32), Q.Q8_0), Q.Q8_0) if a.ndim == 2 else None

    def deq(name, a):
        e = q8(name, a)
        return (gguf.quants.dequantize(e[0], Q.Q8_0).astype(np.float32), Q.F32) if e else None

    for tag, enc in (("q8", q8), ("deq", deq)):
        write_gguf(str(tmp_path / f"{tag}.gguf"), cfg, tensors, src, enc)
    kernels = dict(packed_weights=False)
    a = mbd_rs.Engine.load(str(tmp_path / "q8.gguf"), device="cpu", int8_activations=False, _kernels=kernels)
    b = mbd_rs.Engine.load(str(tmp_path / "deq.gguf"), device="cpu", _kernels=kernels)
    assert a.info.weight_format == "q8_0" and b.info.weight_format == "float32"
    for n, prefix in ((3, 0), (8, 8), (30, 0)):
        la = a.logits(IDS[:prefix + n], attention="causal", prefix_len=prefix)
        assert np.array_equal(la, b.logits(IDS[:prefix + n], attention="causal", prefix_len=prefix)), (n, prefix)


def test_qwen35_metadata_and_mtp_layers(tmp_path):
    """Multi-token-prediction layers stored after the trunk (block_count counts them, each known by its
    blk.N.nextn.* tensors as llama.cpp writes them) are left unread; a count of them that would drop a real layer,
    a recurrent_layers list that does not cover the blocks, a rotary count that is not a count, or value sizes that
    do not divide, are named."""
    import struct
    src = parity_dir("qwen35_hybrid")
    cfg, tensors = read_hf(src)
    exp = np.load(os.path.join(src, "expected.npz"))
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    nextn = {"qwen35.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32)}

    def with_block_count(raw, count):
        key = b"qwen35.block_count"
        i = raw.index(key) + len(key) + 4
        return raw[:i] + struct.pack("<I", count) + raw[i + 4:]

    # an MTP layer as llama.cpp writes it: one more block (a full-attention layer's tensors and its nextn.* ones)
    mtp = {f"blk.{n}.attn_norm.weight": np.ones(h, np.float32),
           f"blk.{n}.nextn.eh_proj.weight": np.zeros((h, 2 * h), np.float32),
           f"blk.{n}.nextn.enorm.weight": np.ones(h, np.float32)}
    p = str(tmp_path / "mtp.gguf")
    write_gguf(p, cfg, tensors, src, raw_tensors=mtp, extra_kv=nextn)
    raw = with_block_count(open(p, "rb").read(), n + 1)  # block_count counts the MTP layer
    eng = load_bytes(tmp_path, raw)
    assert eng.info.num_layers == n
    got = eng.logits(exp["ids"], attention="causal")
    assert float(np.abs(got - exp["causal"]).max() / np.abs(exp["causal"]).max()) <= 1e-4
    # MTP layers that would leave no trunk: named, before any tensor is mapped
    key = b"qwen35.nextn_predict_layers"
    j = raw.index(key) + len(key) + 4
    with pytest.raises(mbd_rs.ConfigError, match=rf"nextn_predict_layers \({n + 1}\) leaves no layer of the {n + 1}"):
        load_bytes(tmp_path, raw[:j] + struct.pack("<I", n + 1) + raw[j + 4:])
    # a count that names the last real layer an MTP layer (it has no nextn tensors): refused, not dropped
    plain = str(tmp_path / "plain.gguf")
    write_gguf(plain, cfg, tensors, src, extra_kv=nextn)
    with pytest.raises(mbd_rs.ConfigError, match=rf"makes block {n - 1} a multi-token-prediction layer, but it holds "
                                                  rf"no blk.{n - 1}.nextn.\* tensors"):
        mbd_rs.Engine.load(plain, device="cpu")
    # nextn tensors in a trunk block: the count and the tensors disagree
    stray = str(tmp_path / "stray.gguf")
    write_gguf(stray, cfg, tensors, src, raw_tensors={"blk.0.nextn.enorm.weight": np.ones(h, np.float32)})
    with pytest.raises(mbd_rs.ConfigError, match=r"block 0 holds multi-token-prediction tensors"):
        mbd_rs.Engine.load(stray, device="cpu")
    # recurrent_layers must hold one flag per block: fewer or more are refused
    for types in (cfg["layer_types"][:2], cfg["layer_types"] + ["linear_attention"]):
        bad = str(tmp_path / "bad.gguf")
        write_gguf(bad, dict(cfg, layer_types=types), tensors, src)
        with pytest.raises(mbd_rs.ConfigError, match=rf"recurrent_layers' must hold a boolean for each of the {n} "
                                                      rf"layers, found {len(types)} entries"):
            mbd_rs.Engine.load(bad, device="cpu")
    raw = open(gguf_of(src, tmp_path / "inner.gguf"), "rb").read()
    # rope.dimension_count of the wrong type (its u32 retyped as an f32): named, not replaced by the default
    key = b"qwen35.rope.dimension_count"
    i = raw.index(key) + len(key)
    assert struct.unpack("<I", raw[i:i + 4])[0] == int(gguf.GGUFValueType.UINT32)
    retyped = raw[:i] + struct.pack("<I", int(gguf.GGUFValueType.FLOAT32)) + raw[i + 4:]
    with pytest.raises(mbd_rs.ConfigError, match=r"metadata 'qwen35.rope.dimension_count' must be a count"):
        load_bytes(tmp_path, retyped)
    key = b"qwen35.ssm.inner_size"
    i = raw.index(key) + len(key) + 4
    raw = raw[:i] + struct.pack("<I", 63) + raw[i + 4:]
    with pytest.raises(mbd_rs.ConfigError, match=r"ssm.inner_size \(63\) must be a multiple of ssm.time_step_rank"):
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


def test_nan_and_inf_metadata_floats_are_errors_naming_the_key(tmp_path):
    """A NaN or infinite float in the metadata (rope theta, rms eps) is refused naming the key; before, a NaN read as
    missing and the field silently took its default."""
    src = parity_dir("qwen2_gqa_tied")
    cfg, tensors = read_hf(src)
    for field, key, x in (("rope_theta", "qwen2.rope.freq_base", float("nan")),
                          ("rms_norm_eps", "qwen2.attention.layer_norm_rms_epsilon", float("inf"))):
        p = str(tmp_path / f"{field}.gguf")
        write_gguf(p, dict(cfg, **{field: x}), tensors, src)
        with pytest.raises(mbd_rs.ConfigError, match=rf"metadata '{key}' is {'NaN' if x != x else 'inf'}; expected "
                                                     r"a finite number"):
            mbd_rs.Engine.load(p, device="cpu")


def test_eos_outside_the_vocabulary_is_refused(tmp_path):
    p = gguf_of(parity_dir("qwen2_gqa_tied"), tmp_path / "eos.gguf", eos_token_id=5000)
    with pytest.raises(mbd_rs.ConfigError, match=r"GGUF metadata as config.json\): field 'eos_token_id': token id 5000 "
                                                 r"is outside the vocabulary of 320 tokens"):
        mbd_rs.Engine.load(p, device="cpu")


# Sparse files: metadata of gigabytes that take nothing on disk. Each load runs in a child under a 3 GB address-space
# limit, which must survive and report its peak RSS.
SPARSE_CHILD = """
import resource
import mbd_rs
try:
    e = mbd_rs.Engine.load(sys.argv[1], device="cpu")
    print("LOADED", e.tokenize("<|im_end|>", add_special_tokens=False))
except mbd_rs.MbdError as e:
    print(type(e).__name__, str(e)[:400])
print("maxrss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def _kv_head(key, vtype):
    k = key.encode()
    return len(k).to_bytes(8, "little") + k + vtype.to_bytes(4, "little")


def _sparse_gguf(path, good, entries, rename=()):
    """`good` (a GGUF file's bytes) with `entries` inserted before its own metadata: each a list of bytes and holes
    (an int: that many zero bytes, left unwritten). A padding entry keeps the data section aligned (32). `rename`:
    keys of `good` renamed in place (same length) so that the inserted ones replace them."""
    for old, new in rename:
        assert len(old) == len(new) and good.count(old) == 1
        good = good.replace(old, new)
    size = sum(len(p) if isinstance(p, bytes) else p for e in entries for p in e)
    pad = _kv_head("general.padding", 8)
    size += len(pad) + 8
    fill = (-size) % 32
    entries = entries + [[pad, fill.to_bytes(8, "little"), fill]]
    n_kv = int.from_bytes(good[16:24], "little") + len(entries)
    with open(path, "wb") as f:
        f.write(good[:16] + n_kv.to_bytes(8, "little"))
        for e in entries:
            for p in e:
                if isinstance(p, bytes):
                    f.write(p)
                else:
                    f.seek(p, os.SEEK_CUR)
        f.write(good[24:])


def _sparse_load(path):
    r = run_child(SPARSE_CHILD, path, limit_mb=3072)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out, rss = r.stdout.rsplit("maxrss_mb", 1)
    return out.strip(), int(rss)


def test_sparse_chat_template_of_gigabytes_is_refused(tmp_path, good_file):
    """A 3.5 GB chat template of NUL bytes: refused at the header, naming the key and the cap (before: read into
    memory, then copied: SIGABRT, "memory allocation of 3670016000 bytes failed")."""
    n = 3_500 << 20
    path = tmp_path / "template.gguf"
    _sparse_gguf(path, good_file, [[_kv_head("tokenizer.chat_template", 8), n.to_bytes(8, "little"), n]],
                 rename=[(b"tokenizer.chat_template", b"tokenizer.chat_templatX")])
    assert os.path.getsize(path) > n and os.stat(path).st_blocks * 512 < 10 << 20  # sparse
    out, rss = _sparse_load(path)
    assert out.startswith("ModelLoadError") and "metadata 'tokenizer.chat_template': a string of 3670016000 bytes; " \
        "at most 4194304 are accepted" in out, out
    assert rss < 1024, rss


def test_sparse_unused_metadata_is_skipped_unread(tmp_path, good_file):
    """1 GB of metadata the loader does not read (8 arrays of 2^24 empty strings, and a 2 GB description): skipped
    without building it, so the file loads, its control tokens right, in bounded memory (before: ~32 bytes per
    element, 7.7 GB RSS for a 1 GB file)."""
    n = 1 << 24
    entries = [[_kv_head(f"general.junk{i}", 9), (8).to_bytes(4, "little"), n.to_bytes(8, "little"), 8 * n]
               for i in range(8)]
    entries.append([_kv_head("general.description", 8), (2 << 30).to_bytes(8, "little"), 2 << 30])
    path = tmp_path / "junk.gguf"
    _sparse_gguf(path, good_file, entries)
    out, rss = _sparse_load(path)
    assert out == "LOADED [2]", out
    assert rss < 1024, rss


def test_sparse_tokenizer_arrays_are_bounded(tmp_path, good_file):
    """A vocabulary of 2^24 empty tokens (a 128 MB hole): the metadata the loader builds is capped, and the error
    says so (before: half a gigabyte of values, then the tokenizer built from them)."""
    n = 1 << 24
    path = tmp_path / "tokens.gguf"
    _sparse_gguf(path, good_file, [[_kv_head("tokenizer.ggml.tokens", 9), (8).to_bytes(4, "little"),
                                    n.to_bytes(8, "little"), 8 * n]],
                 rename=[(b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenX")])
    out, rss = _sparse_load(path)
    assert out.startswith("ModelLoadError") and "metadata 'tokenizer.ggml.tokens': the metadata and tensor table " \
        "would take more than 256 MiB of memory" in out, out
    assert rss < 1024, rss
