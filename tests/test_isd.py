"""I-DLM's introspective strided decoding (speculative="isd"). Greedy ISD must reproduce greedy AR decoding
of the same weights token for token (the exact oracle: each written token is the argmax of a causal row over final
tokens), for every stride, with the cache on and off, with stops inside a step, and in batches; sampled ISD must
write each token distributed as the verifier p (speculative sampling), checked against p computed from the logits
API; and the parameters that do not apply get clear errors."""
import functools

import numpy as np
import pytest

import mbd_rs
from conftest import parity_dir, run_concurrently

MASK = 3
PROMPTS = [[17, 45, 210], [5], [99, 4, 250, 7, 8, 9, 10]]


@functools.lru_cache(maxsize=None)
def engine(name):
    """A random Qwen checkpoint loaded as I-DLM checkpoints are: causal attention, shifted logits."""
    return mbd_rs.Engine.load(parity_dir(name), device="cpu", mask_token_id=MASK, attention="causal",
                              logits_shift=True, eos_token_ids=[0])


@pytest.mark.parametrize("name", ["qwen3_headdim_gqa", "qwen2_gqa_tied", "qwen3moe_top2_norm", "qwen35_hybrid"])
@pytest.mark.parametrize("stride", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
def test_greedy_isd_equals_greedy_ar(name, stride, use_cache):
    eng = engine(name)
    n = 20
    for prompt in PROMPTS:
        ar = eng.generate(prompt, max_tokens=n, early_stop=False)
        s = eng.generate(prompt, max_tokens=n, early_stop=False, speculative="isd", isd_stride=stride,
                         use_cache=use_cache)
        assert s.token_ids == ar.token_ids
        u = s.usage
        # a step writes its accepted drafts and one more token, but the last one when its drafts reach the end
        assert u.forward_passes + u.drafts_accepted in (n, n + 1)
        assert u.drafts_accepted <= u.drafts_proposed <= (stride - 1) * u.verifications
        assert u.verifications <= u.forward_passes
        if stride == 1:
            assert u.forward_passes == n and u.drafts_proposed == 0


def test_some_drafts_are_accepted_and_save_forwards():
    """On random weights drafts from mask rows are seldom right, but some are: across the fixtures ISD needs fewer
    forwards than AR (so the acceptance path is exercised, not only the corrections)."""
    accepted, forwards = 0, 0
    for name in ["qwen3_headdim_gqa", "qwen2_gqa_tied", "qwen3moe_top2_norm"]:
        for prompt in PROMPTS:
            u = engine(name).generate(prompt, max_tokens=20, early_stop=False, speculative="isd").usage
            accepted, forwards = accepted + u.drafts_accepted, forwards + u.forward_passes
    assert accepted > 0 and forwards < 9 * 20


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
def test_stops_inside_a_step_and_logprobs_are_the_verifiers(use_cache):
    """A stop token or an EOS written in the middle of a step ends the text where AR decoding ends it; the
    log-probabilities are the verifier's rows, i.e. AR decoding's."""
    eng = engine("qwen2_gqa_tied")
    for prompt in PROMPTS:
        full = eng.generate(prompt, max_tokens=16, early_stop=False).token_ids
        stop = [full[6]]
        ar = eng.generate(prompt, max_tokens=16, stop_token_ids=stop, logprobs=2)
        s = eng.generate(prompt, max_tokens=16, stop_token_ids=stop, logprobs=2, speculative="isd", isd_stride=4,
                         use_cache=use_cache)
        assert s.token_ids == ar.token_ids and s.text == ar.text and s.finish_reason == ar.finish_reason == "stop"
        assert len(s.logprobs) == len(ar.logprobs) > 0
        for a, b in zip(s.logprobs, ar.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_batched_isd_streams_equal_lone_runs():
    """ISD steps share forwards with other streams (other strides, S2D2-free AR, sampling) and give exactly what
    each gives alone."""
    eng = engine("qwen3_headdim_gqa")
    reqs = []
    for i in range(8):
        prompt = [(i * 31 + j * 17 + 5) % 200 + 4 for j in range(2 + (i * 7) % 23)]
        kw = dict(max_tokens=[13, 5, 24, 9][i % 4], early_stop=False, seed=i, use_cache=(i % 3 != 2))
        if i % 4 != 3:
            kw.update(speculative="isd", isd_stride=[2, 4, 6][i % 3])
        if i % 2 == 1:
            kw["temperature"] = 0.9
        reqs.append((prompt, kw))

    def run(prompt, kw):
        c = eng.generate(prompt, **kw)
        return c.token_ids, c.usage.forward_passes, c.usage.drafts_accepted

    assert run_concurrently(run, reqs) == [run(p, kw) for p, kw in reqs]


def _dist(row, top_k):
    """softmax(row) restricted to its top_k tokens, renormalised (temperature 1): the sampling distribution."""
    idx = np.argsort(-row, kind="stable")[:top_k]
    p = np.exp(row[idx] - row[idx].max())
    return dict(zip(idx.tolist(), (p / p.sum()).tolist()))


def test_sampled_isd_writes_tokens_distributed_as_the_verifier():
    """With max_tokens=2 the first step (pending = the prompt's last token, one mask) writes t0 from p and drafts
    t1 from the mask row (q); the second verifies the draft: t1 is the accepted draft or a draw from the residual
    max(0, p - q). By the speculative sampling theorem t1 | t0 is distributed as p(. | prompt, t0), which the logits
    API gives; q differs from it enough that a wrong rule (taking drafts as they are) would show."""
    eng = engine("qwen2_gqa_tied")
    prompt, top_k, runs = [99, 4, 250], 4, 3000
    t0s, pairs, proposed, accepted = {}, {}, 0, 0
    for seed in range(runs):
        c = eng.generate(prompt, max_tokens=2, early_stop=False, temperature=1.0, top_k=top_k, seed=seed,
                         speculative="isd", isd_stride=4)
        t0, t1 = c.token_ids
        t0s[t0] = t0s.get(t0, 0) + 1
        pairs.setdefault(t0, []).append(t1)
        proposed, accepted = proposed + c.usage.drafts_proposed, accepted + c.usage.drafts_accepted
    assert proposed == runs and 0.1 * runs < accepted < 0.9 * runs  # both accepted drafts and corrections

    def check(counts, p, n):
        for t, pt in p.items():
            f = counts.get(t, 0) / n
            assert abs(f - pt) < 4.5 * np.sqrt(pt * (1 - pt) / n) + 1e-3, (t, f, pt)
        assert set(counts) <= set(p)

    p0 = _dist(eng.logits(prompt)[-1], top_k)
    check(t0s, p0, runs)
    t0 = max(pairs, key=lambda t: len(pairs[t]))
    ones = pairs[t0]
    p1 = _dist(eng.logits(prompt + [t0])[-1], top_k)
    q1 = _dist(eng.logits(prompt + [MASK])[-1], top_k)  # the draft's row: the mask where t0 now stands
    tv = 0.5 * sum(abs(p1.get(t, 0) - q1.get(t, 0)) for t in set(p1) | set(q1))
    assert tv > 0.2, tv
    check({t: ones.count(t) for t in set(ones)}, p1, len(ones))


@pytest.mark.parametrize("kw,msg", [
    (dict(isd_stride=3), "isd_stride only applies with speculative='isd'"),
    (dict(speculative="isd", isd_stride=0), "isd_stride must be >= 1"),
    (dict(speculative="isd", block_size=4, threshold=0.5), "block_size, threshold do not apply with speculative='isd'"),
    (dict(speculative="isd", verify_policy="always"), "verify_policy only applies with speculative='s2d2'"),
    (dict(speculative="isd", cache="prefix"), "cache='prefix' is an approximate cache for full attention"),
])
def test_bad_isd_parameters(kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        engine("qwen3_headdim_gqa").generate([5, 6], max_tokens=4, **kw)


def test_isd_needs_a_causal_shifted_model():
    block_causal = mbd_rs.Engine.load()  # the embedded model: block-causal, unshifted
    with pytest.raises(mbd_rs.InvalidRequestError, match="load I-DLM checkpoints with attention='causal'"):
        block_causal.generate([5, 6], max_tokens=4, speculative="isd")
    unshifted = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), device="cpu", mask_token_id=MASK,
                                   attention="causal", logits_shift=False)
    with pytest.raises(mbd_rs.InvalidRequestError, match="unshifted logits"):
        unshifted.generate([5, 6], max_tokens=4, speculative="isd")
