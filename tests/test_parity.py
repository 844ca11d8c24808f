"""Logits parity with HF transformers, from fixtures recorded by scripts/make_parity_fixtures.py
(transformers' eager attention with an explicit 4-D mask built from the block definition)."""
import numpy as np
import pytest

import mbd_rs
from conftest import load_cases, parity_dir

META = load_cases()
CASES = META["cases"]
FIXTURES = META["fixtures"]


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=FIXTURES)
def loaded(request):
    name = request.param
    return name, mbd_rs.Engine.load(parity_dir(name), device="cpu"), np.load(f"{parity_dir(name)}/expected.npz")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(loaded, case):
    name, eng, exp = loaded
    c = CASES[case]
    got = eng.logits(exp["ids"], attention=c["attention"], block_size=c["block_size"], alignment=c["alignment"],
                     prompt_len=c["prompt_len"])
    assert got.dtype == np.float32 and got.shape == exp[case].shape
    assert rel_err(got, exp[case]) <= 1e-4, (name, case, rel_err(got, exp[case]))


def test_masks_really_differ(loaded):
    # Guard against a vacuous parity test: the recorded cases must differ from each other.
    _, _, exp = loaded
    assert rel_err(exp["block4_absolute"], exp["causal"]) > 1e-2
    assert rel_err(exp["full"], exp["block4_absolute"]) > 1e-2
    assert rel_err(exp["block4_prompt6"], exp["block4_absolute"]) > 1e-2


PREFIX_CASES = [
    ("causal", 1, "absolute", None, 7),
    ("causal", 1, "absolute", None, 18),
    ("block_causal", 4, "absolute", None, 8),
    ("block_causal", 4, "absolute", None, 16),
    ("block_causal", 3, "absolute", None, 9),
    ("block_causal", 4, "prompt", 6, 6),
    ("block_causal", 4, "prompt", 6, 14),
]


@pytest.mark.parametrize("attention,bs,alignment,plen,prefix", PREFIX_CASES)
def test_prefix_cache_path_equals_no_cache(loaded, attention, bs, alignment, plen, prefix):
    _, eng, exp = loaded
    kw = dict(attention=attention, block_size=bs, alignment=alignment, prompt_len=plen)
    full = eng.logits(exp["ids"], **kw)
    cached = eng.logits(exp["ids"], prefix_len=prefix, **kw)
    assert rel_err(cached, full) <= 1e-5


def test_prefix_must_sit_on_block_boundary():
    eng = mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), device="cpu")
    ids = list(range(10, 29))
    with pytest.raises(mbd_rs.InvalidRequestError, match="prefix_len 6 splits an attention block"):
        eng.logits(ids, attention="block_causal", block_size=4, prefix_len=6)
    with pytest.raises(mbd_rs.InvalidRequestError, match="splits an attention block"):
        eng.logits(ids, attention="full", prefix_len=4)
    with pytest.raises(mbd_rs.InvalidRequestError, match="prompt_len is required"):
        eng.logits(ids, attention="block_causal", alignment="prompt", block_size=4)


def test_bf16_checkpoint_matches_f32_twin():
    a = mbd_rs.Engine.load(parity_dir("qwen3_bf16"), device="cpu")
    b = mbd_rs.Engine.load(parity_dir("qwen3_bf16_f32twin"), device="cpu")
    assert a.info.stored_dtype == "bfloat16" and b.info.stored_dtype == "float32"
    assert a.info.dtype == "float32"  # CPU computes in f32 whatever the stored dtype
    ids = list(range(3, 40, 2))
    la = a.logits(ids, attention="block_causal", block_size=4)
    lb = b.logits(ids, attention="block_causal", block_size=4)
    assert rel_err(la, lb) <= 1e-2
    assert np.array_equal(la.argmax(-1), lb.argmax(-1))


@pytest.mark.parametrize("kernels", [{}, dict(max_rows=4)], ids=["few-row", "gemm"])
@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_stacked_projections_equal_separate_products(kernels, quantize):
    # q/k/v and gate/up held as one matrix each (the default) against one product per layer, dense and quantized,
    # for every fixture (qkv biases, qk-norm, both MoE layouts): the few-row kernel computes each output column
    # alone, so the same bits; gemm (max_rows=4: windows of 5+ rows) may block a wider matrix differently, so the
    # same values to rounding
    ids = list(range(3, 40, 2))
    kw = dict(attention="block_causal", block_size=4)
    few = not kernels
    for name in FIXTURES:
        a, b = (mbd_rs.Engine.load(parity_dir(name), device="cpu", quantize=quantize,
                                   _kernels=dict(stack=stack, **kernels)) for stack in (True, False))
        for prefix in (None, 8, 16):
            la, lb = a.logits(ids, prefix_len=prefix, **kw), b.logits(ids, prefix_len=prefix, **kw)
            if few:
                assert np.array_equal(la, lb), (name, quantize, prefix, float(np.abs(la - lb).max()))
            else:
                assert rel_err(la, lb) <= 1e-5, (name, quantize, prefix, rel_err(la, lb))
