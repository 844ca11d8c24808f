"""Log-probabilities: each generated token's under the forward that decided it (`logprobs=k`; the
reference-decoder parity of the values is in test_decode_parity.py), and a prompt's left-to-right scores
(`Engine.prompt_logprobs`) against transformers by their definition, one forward per position
(tests/fixtures/decode/prompt_logprobs.json, recorded by scripts/make_decode_fixtures.py)."""
import functools
import json
import math
import os

import pytest

import mbd_rs
from conftest import HERE, parity_dir

SCORES = json.load(open(os.path.join(HERE, "fixtures", "decode", "prompt_logprobs.json")))["scores"]


@functools.lru_cache(maxsize=None)
def engine(name, shift, attention="block_causal"):
    return mbd_rs.Engine.load(parity_dir(name), device="cpu", mask_token_id=3, attention=attention,
                              alignment="absolute", logits_shift=shift, eos_token_ids=[0])


def check_shape(c, eos_ids):
    """One TokenLogprob per token id, then one for the EOS when the generation ended at one."""
    assert [x.token_id for x in c.logprobs[:len(c.token_ids)]] == c.token_ids
    extra = c.logprobs[len(c.token_ids):]
    assert len(extra) <= 1
    if extra:
        assert c.finish_reason == "stop" and extra[0].token_id in eos_ids
    return c.logprobs


@pytest.mark.parametrize("case", SCORES, ids=[f"{c['model']}-shift{c['logits_shift']}-len{len(c['ids'])}"
                                              for c in SCORES])
def test_prompt_logprobs_match_the_definition(case):
    """Unshifted: a mask at each position seeing the tokens before it (all in one forward, two rows per
    position, in chunks of 128); shifted: the previous row under causal attention. Both against one transformers
    forward per position."""
    eng = engine(case["model"], case["logits_shift"])
    got = eng.prompt_logprobs(case["ids"], logprobs=3)
    assert len(got) == len(case["ids"]) and got[0] is None
    for i, (g, want, top) in enumerate(zip(got[1:], case["logprobs"][1:], case["top3"][1:]), start=1):
        assert g.token_id == case["ids"][i]
        assert abs(g.logprob - want) <= 2e-4, (i, g.logprob, want)
        assert [t for t, _ in g.top_logprobs] == top, i
        assert g.top_logprobs[0][1] >= g.logprob - 1e-6
        assert all(a[1] >= b[1] for a, b in zip(g.top_logprobs, g.top_logprobs[1:]))


def test_prompt_logprobs_of_causal_attention_models_and_text_prompts():
    """A plain causal profile scores like the shifted block-causal one (block size 1 is causal); a text prompt
    is tokenized as for generation; logprobs defaults to the token's own only."""
    case = next(c for c in SCORES if c["logits_shift"] and len(c["ids"]) < 50)
    a = engine(case["model"], True, "causal").prompt_logprobs(case["ids"])
    b = engine(case["model"], True).prompt_logprobs(case["ids"])
    assert [x.logprob for x in a[1:]] == pytest.approx([x.logprob for x in b[1:]], abs=1e-5)
    assert all(x.top_logprobs == [] for x in a[1:])
    eng = mbd_rs.Engine.load()
    text = "sort: 3 1 2 = 1 2 3"
    by_text, by_ids = eng.prompt_logprobs(text), eng.prompt_logprobs(eng.tokenize(text))
    assert by_text == by_ids and by_text[0] is None and all(x.logprob <= 0 for x in by_text[1:])
    assert engine(case["model"], True).prompt_logprobs(case["ids"][:1]) == [None]


def test_greedy_s2d2_logprobs_are_the_left_to_right_scores():
    """With greedy always-verify S2D2 and a prompt shorter than a block, every token is the verifier's
    block-size-1 prediction, so its log-probability is the left-to-right score of prompt + completion there
    (two paths through the engine: the generation's verification forwards and prompt scoring)."""
    for name, shift in [("qwen3_headdim_gqa", False), ("qwen2_gqa_tied", True)]:
        eng = engine(name, shift)
        prompt = [17, 45, 210]
        out = eng.generate(prompt, max_tokens=10, early_stop=False, speculative="s2d2", verify_policy="always",
                           logprobs=2)
        scores = eng.prompt_logprobs(prompt + out.token_ids, logprobs=2)[len(prompt):]
        check_shape(out, [0])
        for g, s in zip(out.logprobs, scores):
            assert g.logprob == pytest.approx(s.logprob, abs=1e-4)
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in s.top_logprobs]


def test_generation_logprobs_shape_streaming_and_sampling():
    eng = mbd_rs.Engine.load()
    plain = eng.generate("sort: 3 1 2 =", max_tokens=12)
    assert plain.logprobs == []  # not asked for
    eos = eng.info.eos_token_ids
    out = eng.generate("sort: 3 1 2 =", max_tokens=12, logprobs=0)
    assert out.token_ids == plain.token_ids  # asking for log-probabilities changes no token
    assert all(x.top_logprobs == [] for x in check_shape(out, eos))
    assert all(-50 < x.logprob <= 0 for x in out.logprobs)
    # a generation that ends at its EOS lists the EOS last
    ended = eng.chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=12, logprobs=0)
    assert ended.finish_reason == "stop" and len(check_shape(ended, eos)) == len(ended.token_ids) + 1
    # greedy: the decided token is the most likely one of its forward
    top = eng.generate("sort: 3 1 2 =", max_tokens=12, logprobs=5).logprobs
    assert all(x.top_logprobs[0] == (x.token_id, x.logprob) and len(x.top_logprobs) == 5 for x in top)
    # streamed chunks carry their tokens' log-probabilities, in order
    chunks = list(eng.stream("sort: 3 1 2 =", max_tokens=12, logprobs=1))
    streamed = [x for c in chunks for x in c.logprobs]
    assert [x.token_id for x in streamed] == [x.token_id for x in out.logprobs]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in out.logprobs], abs=1e-6)
    # sampling: the log-probability is of the raw logits (temperature does not change it), so a sampled token's
    # is at most the top one's, and the probabilities of the listed alternatives sum to at most 1
    s = eng.generate("sort: 3 1 2 =", max_tokens=12, logprobs=3, temperature=1.5, seed=3)
    assert len(check_shape(s, eos)) > 0
    for x in s.logprobs:
        assert x.logprob <= x.top_logprobs[0][1] + 1e-6
        assert sum(math.exp(lp) for _, lp in x.top_logprobs) <= 1 + 1e-5
    check_shape(eng.chat([{"role": "user", "content": "sort: 3 1 2"}], max_tokens=6, logprobs=2), eos)


@pytest.mark.parametrize("call,message", [
    (lambda e: e.prompt_logprobs([5, 6], logprobs=21), "logprobs must be between 0 and 20, got 21"),
    (lambda e: e.prompt_logprobs([5, 6], logprobs=-1), "logprobs must be between 0 and 20, got -1"),
    (lambda e: e.prompt_logprobs([5, 6], logprobs=1.5), "logprobs must be an integer"),
    (lambda e: e.prompt_logprobs([5, 6], top=2), "unexpected scoring parameter 'top'"),
    (lambda e: e.prompt_logprobs([]), "the prompt is empty"),
    (lambda e: e.prompt_logprobs([5, 9999]), "prompt: token id 9999 at index 1 is out of range"),
    (lambda e: e.generate([5, 6], max_tokens=2, logprobs=30), "logprobs must be between 0 and 20, got 30"),
    (lambda e: e.generate([5, 6], max_tokens=2, logprobs=True), "logprobs must be an integer"),
])
def test_bad_requests_are_refused(call, message):
    # an unknown keyword is a TypeError, as for any Python function; bad values are InvalidRequestError
    kind = TypeError if "unexpected" in message else mbd_rs.InvalidRequestError
    with pytest.raises(kind) as e:
        call(engine("qwen3_headdim_gqa", False))
    assert message in str(e.value)


def test_full_attention_has_no_left_to_right_likelihood():
    eng = engine("qwen3_headdim_gqa", True, "full")
    with pytest.raises(mbd_rs.InvalidRequestError, match="needs block-causal or causal attention"):
        eng.prompt_logprobs([5, 6, 7])
    # generation still reports its tokens' log-probabilities (of the forward that decided each)
    out = eng.generate([5, 6, 7], max_tokens=6, early_stop=False, logprobs=1)
    assert len(check_shape(out, [0])) >= len(out.token_ids) > 0
