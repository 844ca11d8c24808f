"""Greedy decoding parity with the reference decoder (tests/reference/decoder.py, written from the
specification over HF transformers). Fixtures recorded by scripts/make_decode_fixtures.py: identical
tokens and identical forward counts, with and without the KV cache, and each token's log-probability under the
forward that decided it (logprobs=3: the value and the 3 most likely ids)."""
import functools
import json
import os

import pytest

import mbd_rs
from conftest import HERE, parity_dir
from fixture_params import generate_kwargs

CASES = json.load(open(os.path.join(HERE, "fixtures", "decode", "cases.json")))["cases"]


@functools.lru_cache(maxsize=None)
def engine(model, attention, alignment, shift, eos):
    return mbd_rs.Engine.load(parity_dir(model), device="cpu", mask_token_id=3, attention=attention,
                              alignment=alignment, logits_shift=shift, eos_token_ids=list(eos))


def run(case, use_cache):
    p = case["params"]
    eng = engine(case["model"], p["attention"], p["alignment"], p["logits_shift"], tuple(case["eos_token_ids"]))
    if p.get("cache") and not use_cache:
        pytest.skip("the approximate cache has no uncached twin (the 'full_attention' cases are cache='none')")
    kw = generate_kwargs(p)
    if not p.get("tccf"):  # TCCF: no log-probabilities (its check text is not the model's)
        kw["logprobs"] = 3
    return eng.generate(case["prompt"], max_tokens=case["max_tokens"], use_cache=use_cache, **kw)


IDS = [f"{c['model']}-lp{len(c['prompt'])}-{c['variant']}" for c in CASES]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_reference_decoder(case, use_cache):
    out = run(case, use_cache)
    assert out.token_ids == case["completion"]
    assert out.usage.forward_passes == case["forward_passes"]
    assert out.finish_reason == case["finish_reason"]
    assert out.usage.completion_tokens == len(case["completion"])
    if case["params"].get("s2d2"):
        assert out.usage.drafts_accepted <= out.usage.drafts_proposed
    if case["params"].get("tccf"):
        return
    ended_at_eos = len(out.logprobs) == len(out.token_ids) + 1
    assert [t.token_id for t in out.logprobs[:len(out.token_ids)]] == out.token_ids
    assert ended_at_eos == (out.finish_reason == "stop")  # no stop strings here: "stop" is an EOS
    if ended_at_eos:
        assert out.logprobs[-1].token_id in case["eos_token_ids"]
    assert len(out.logprobs) == len(case["completion_logprobs"])
    for got, want, top in zip(out.logprobs, case["completion_logprobs"], case["completion_top3"]):
        assert abs(got.logprob - want) <= 2e-4, (got, want)
        assert len(got.top_logprobs) == 3 and [t for t, _ in got.top_logprobs] == top
        assert got.top_logprobs[0][1] >= got.logprob - 1e-6


def test_fixtures_exercise_the_features():
    # The fixture set must contain partial acceptance (several tokens in a forward), EOS stops, and AR.
    tpf = [len(c["completion"]) / c["forward_passes"] for c in CASES]
    assert max(tpf) >= 3.0
    assert any(c["finish_reason"] == "stop" for c in CASES)
    assert all(c["forward_passes"] == c["max_tokens"] for c in CASES if c["variant"] == "ar_b1")
    # S2D2 cases verify (a verified step costs two forwards, so some step took more than one forward) and some
    # accept several drafts in one verification (more tokens than steps)
    s2d2 = [c for c in CASES if c["params"].get("s2d2")]
    assert len(s2d2) >= 20 and any(c["forward_passes"] > len(c["completion"]) for c in s2d2)


@pytest.mark.parametrize("attention,alignment,block_size,shift", [
    ("causal", "absolute", 1, True),
    ("block_causal", "absolute", 4, False),
    ("block_causal", "absolute", 5, True),  # 512 is not a multiple of 5: the chunk grows to the block's end
    ("block_causal", "prompt", 4, False),  # the prompt is one block: it cannot be split
])
def test_long_prompt_prefill_in_chunks_matches_recompute(model_copy, attention, alignment, block_size, shift):
    """Prompts longer than the prefill chunk (512) fill the cache in several forwards; decoding must be the
    same as with no cache at all (every forward recomputes the whole sequence)."""
    d = model_copy(edit_config=lambda c: c.update(max_position_embeddings=2048))
    eng = mbd_rs.Engine.load(d, device="cpu", mask_token_id=3, attention=attention, alignment=alignment,
                             logits_shift=shift, eos_token_ids=[0])
    prompt = [(7 * i + 11) % 300 + 4 for i in range(1100)]
    kw = dict(max_tokens=12, block_size=block_size, early_stop=False, threshold=0.9, acceptance="confidence")
    cached, recomputed = eng.generate(prompt, **kw), eng.generate(prompt, use_cache=False, **kw)
    assert cached.token_ids == recomputed.token_ids and len(cached.token_ids) > 0
    assert cached.usage.forward_passes == recomputed.usage.forward_passes
