"""S2D2 self-speculative verification and Fast-dLLM v2 sub-blocks. The reference parity (tokens
and forward counts against tests/reference/decoder.py over transformers, with and without the cache) is in
test_decode_parity.py; here: the AR equivalence of greedy always-verify decoding, sampling, the usage
counters, the sub-block walk, and bad parameters."""
import functools

import pytest

import mbd_rs
from conftest import parity_dir


@functools.lru_cache(maxsize=None)
def engine(name, shift):
    return mbd_rs.Engine.load(parity_dir(name), device="cpu", mask_token_id=3, attention="block_causal",
                              alignment="absolute", logits_shift=shift, eos_token_ids=[0])


PROMPTS = [[17, 45, 210], [5], [99, 3 + 1, 250]]


@pytest.mark.parametrize("name,shift", [("qwen3_headdim_gqa", False), ("qwen2_gqa_tied", True),
                                        ("qwen3moe_top2_norm", False)])
@pytest.mark.parametrize("alpha", [1.0, 0.1], ids=["single_block", "multi_block"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
def test_greedy_always_verify_equals_ar_decoding(name, shift, alpha, use_cache):
    """Every token a greedy always-verify step commits is the verifier's block-size-1 prediction, and the
    verified positions keep causal K/V; with a prompt shorter than one block (so that it is causal too) the
    output is exactly AR decoding (block_size=1) of the same model."""
    eng = engine(name, shift)
    for prompt in PROMPTS:
        ar = eng.generate(prompt, max_tokens=14, block_size=1, early_stop=False)
        s = eng.generate(prompt, max_tokens=14, block_size=4, block_add_threshold=alpha, early_stop=False,
                         speculative="s2d2", verify_policy="always", use_cache=use_cache)
        assert s.token_ids == ar.token_ids
        u = s.usage
        assert u.forward_passes == 2 * u.verifications
        assert 0 <= u.drafts_accepted <= u.drafts_proposed and u.verifications >= 1
        # each verification commits its accepted drafts and, at a rejection, the verifier's token
        assert u.verifications <= 14 <= u.verifications + u.drafts_accepted


def test_tiny_model_s2d2_matches_ar_and_beats_one_token_per_forward():
    """On the trained embedded model (block 4), S2D2 with a prompt shorter than a block equals AR decoding,
    and accepts drafts (more than one token per verification)."""
    eng = mbd_rs.Engine.load()
    prompt = eng.tokenize("sort: 3 1 2 =")[:3]
    ar = eng.generate(prompt, max_tokens=24, block_size=1)
    s = eng.generate(prompt, max_tokens=24, speculative="s2d2", verify_policy="always")
    assert s.token_ids == ar.token_ids
    assert s.usage.drafts_accepted > 0 and s.usage.acceptance_rate > 0


def test_sampling_is_seeded_and_counts():
    eng = engine("qwen3_headdim_gqa", False)
    kw = dict(max_tokens=16, temperature=1.0, seed=11, speculative="s2d2", verify_policy="always", early_stop=False)
    a, b = eng.generate([7, 8, 9, 10, 11], **kw), eng.generate([7, 8, 9, 10, 11], **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.usage.verifications == b.usage.verifications > 0
    cached, recomputed = eng.generate([7, 8, 9, 10, 11], **kw), eng.generate([7, 8, 9, 10, 11], use_cache=False, **kw)
    assert cached.token_ids == recomputed.token_ids


def test_policies_route_differently():
    eng = engine("qwen3_headdim_gqa", False)
    p = [30, 31, 32, 33, 34, 35]
    base = dict(max_tokens=19, threshold=2.5, early_stop=False, speculative="s2d2")
    always = eng.generate(p, verify_policy="always", **base).usage
    never = eng.generate(p, verify_policy="min_span", verify_min_span=100, **base).usage
    plain = eng.generate(p, max_tokens=19, threshold=2.5, early_stop=False).usage
    assert never.verifications == 0 and never.forward_passes == plain.forward_passes
    assert always.verifications > 0 and always.forward_passes == 2 * always.verifications


def test_usage_without_speculation_is_zero():
    u = engine("qwen3_headdim_gqa", False).generate([5, 6], max_tokens=4).usage
    assert (u.verifications, u.drafts_proposed, u.drafts_accepted, u.acceptance_rate) == (0, 0, 0, 0.0)


def test_sub_blocks_walk_left_to_right():
    """With sub-blocks every step decodes inside one sub-block, and a sub-block starts only when the one
    before it is complete."""
    eng = engine("qwen3_headdim_gqa", False)
    events = [c.step for c in eng.stream([9, 9, 9, 9, 9, 9, 9, 9], max_tokens=24, block_size=8, sub_block_size=4,
                                          threshold=0.3, acceptance="confidence", block_add_threshold=1.0,
                                          early_stop=False, trace=True)
              if c.step is not None]
    done = set()
    for e in events:
        subs = {d // 4 for d in e.decoded}
        assert len(subs) == 1
        k = subs.pop()
        assert all(j in done for j in range(4 * k))
        done |= set(e.decoded)
    assert done == set(range(24))


def test_fast_dllm_v2_family_defaults_to_sub_blocks(model_copy):
    d = model_copy("qwen2_mha_untied", edit_config=lambda c: c.update(
        architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=16))
    eng = mbd_rs.Engine.load(d, eos_token_ids=[0])
    events = [c.step for c in eng.stream([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], max_tokens=32,
                                          early_stop=False, trace=True) if c.step is not None]
    # sub-blocks of 8 inside blocks of 16; each block's first token alone (from the previous block's last logit)
    assert all(len({d // 8 for d in e.decoded}) == 1 for e in events)
    starts = [e for e in events if 0 in e.decoded or 16 in e.decoded]
    assert all(len(e.decoded) == 1 for e in starts) and len(starts) == 2


@pytest.mark.parametrize("kw,msg", [
    (dict(verify_policy="always"), "only applies with speculative='s2d2'"),
    (dict(verify_hysteresis=[1, -5]), "only applies with speculative='s2d2'"),
    (dict(speculative="eagle"), "speculative must be 'off', 's2d2' or 'isd'"),
    (dict(speculative="s2d2", verify_policy="sometimes"), "verify_policy must be"),
    (dict(speculative="s2d2", verify_hysteresis=[1.0]), "two numbers"),
    (dict(speculative="s2d2", verify_hysteresis=[-5, 1]), "greater than off"),
    (dict(speculative="s2d2", verify_hysteresis="1,-5"), "verify_hysteresis must be a list of numbers"),
    (dict(speculative="s2d2", verify_hysteresis=[1, "x"]), "item 1 is not a number"),
    (dict(speculative="s2d2", verify_hysteresis=[1, float("nan")]), "must be finite"),
    (dict(speculative="s2d2", verify_min_span=0), "verify_min_span must be >= 1"),
    (dict(speculative="s2d2", verify_penalty=-1), "verify_penalty must be >= 0"),
    (dict(speculative="s2d2", verify_penalty_kind="linear"), "verify_penalty_kind must be"),
    (dict(sub_block_size=0), "sub_block_size must be >= 1"),
])
def test_bad_parameters_are_clear_errors(kw, msg):
    eng = engine("qwen3_headdim_gqa", False)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        eng.generate([5, 6], max_tokens=4, **kw)


def test_s2d2_needs_block_causal_or_causal_attention():
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="full", logits_shift=True)
    with pytest.raises(ValueError, match="full attention"):
        eng.generate([5, 6], max_tokens=4, speculative="s2d2")
