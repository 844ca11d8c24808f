"""Continuous batching never changes outputs: concurrent streams of one engine, batched by the engine's scheduler,
give exactly the tokens, texts and forward counts they give when each runs alone — with different prompts,
lengths, block sizes, cache policies, thresholds and sampling seeds, with cancels and abandoned streams mid-way,
and with the batch caps at their edges. (The forward-level invariant, logits bit for bit, is in
crates/mbd-core/tests/batching.rs.)"""
import threading

import pytest

import mbd_rs
from conftest import parity_dir


def _requests(n, speculative=True, approx_cache=False):
    """n varied requests; `speculative`: some verify with S2D2 and some walk sub-blocks (verification segments
    with custom masks share ticks with plain windows); `approx_cache` (full attention): some use the prefix or the
    dual cache (region windows over reordered prefix+suffix K/V next to whole-canvas forwards)."""
    out = []
    for i in range(n):
        prompt = [(i * 31 + j * 17 + 5) % 200 + 4 for j in range(3 + (i * 7) % 40)]
        kw = dict(max_tokens=[13, 5, 24, 9, 31][i % 5], block_size=[4, 2, 8][i % 3],
                  threshold=[0.9, 0.5, 0.99, 0.7][i % 4], use_cache=(i % 5 != 3), acceptance="confidence",
                  early_stop=False, seed=i)
        if i % 4 == 1:
            kw["temperature"] = 0.8
        if speculative and i % 3 == 1:
            kw.update(speculative="s2d2", verify_policy=["always", "score", "hysteresis", "min_span"][i % 4],
                      verify_min_span=2)
        if speculative and i % 4 == 2:
            kw["sub_block_size"] = 2
        if approx_cache and kw["use_cache"] and i % 3 != 1:
            kw["cache"] = "prefix" if i % 3 == 0 else "dual"
        out.append((prompt, kw))
    return out


def _run(eng, prompt, kw):
    c = eng.generate(prompt, **kw)
    return c.token_ids, c.text, c.finish_reason, c.usage.forward_passes


def _concurrently(eng, reqs, cancel=(), abandon=()):
    """Run every request in its own thread at once; `cancel`: indices cancelled after their first chunk;
    `abandon`: indices whose stream is closed after their first chunk."""
    got = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def work(i):
        prompt, kw = reqs[i]
        start.wait()
        s = eng.stream(prompt, **kw)
        if i in cancel or i in abandon:
            first = next(s)
            if i in abandon:
                s.close()
                got[i] = first.token_ids
                return
            s.cancel()
            rest = list(s)
            got[i] = (first.token_ids + [t for c in rest for t in c.token_ids], s.finish_reason)
            return
        c = s.result()
        got[i] = c.token_ids, c.text, c.finish_reason, c.usage.forward_passes

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    [t.start() for t in ts]
    [t.join(timeout=120) for t in ts]
    assert not any(t.is_alive() for t in ts), "a stream hung"
    return got


@pytest.fixture(scope="module")
def sdar():
    # SDAR-like: block-causal, unshifted (random weights: windows of every size occur)
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                              logits_shift=False, block_size=4)


def batched_equals_alone(eng, n):
    """n varied requests run alone, then all at once: the same outputs, and they were batched (fewer forwards than
    stream steps)."""
    reqs = _requests(n)
    alone = [_run(eng, p, kw) for p, kw in reqs]
    f0, s0, _ = eng.batch_stats
    got = _concurrently(eng, reqs)
    f1, s1, _ = eng.batch_stats
    assert got == alone
    assert s1 - s0 > f1 - f0 > 0


def test_concurrent_streams_equal_streams_alone(sdar):
    batched_equals_alone(sdar, 12)


@pytest.mark.parametrize("overrides", [
    dict(attention="block_causal", logits_shift=True, alignment="prompt"),  # Fast-dLLM-v2/D2F-like, shifted
    dict(attention="full", logits_shift=True),  # Dream-like: every step recomputes the canvas
    dict(attention="causal", logits_shift=True, block_size=1),  # autoregressive: one-row windows
])
def test_other_profiles_batched_equal_alone(overrides):
    eng = mbd_rs.Engine.load(parity_dir("qwen3_bias_tied"), mask_token_id=3, **overrides)
    reqs = [(p, {k: v for k, v in kw.items() if not (overrides["attention"] == "causal" and k == "block_size")})
            for p, kw in _requests(9, speculative=overrides["attention"] != "full",
                                   approx_cache=overrides["attention"] == "full")]
    alone = [_run(eng, p, kw) for p, kw in reqs]
    assert _concurrently(eng, reqs) == alone


def test_embedded_model_batched_equals_alone():
    eng = mbd_rs.Engine.load()
    prompts = ["Q: 2+3=", "Q: what is 17+25?", "hello", "Q: 9*9=", "The capital of", "1 2 3 4", "Q: 50-8=", "abc"]
    reqs = [(p, dict(max_tokens=16 + 4 * i)) for i, p in enumerate(prompts)]
    alone = [_run(eng, p, kw) for p, kw in reqs]
    assert _concurrently(eng, reqs) == alone


def test_cancelled_and_abandoned_streams_leave_the_others_unchanged(sdar):
    reqs = _requests(10)
    for _, kw in reqs:
        kw["max_tokens"] = 40
    alone = [_run(sdar, p, kw) for p, kw in reqs]
    got = _concurrently(sdar, reqs, cancel={2, 7}, abandon={4})
    for i in range(len(reqs)):
        if i in (2, 7):
            tokens, finish = got[i]
            assert finish == "cancelled" and alone[i][0][:len(tokens)] == tokens
        elif i == 4:
            assert alone[i][0][:len(got[i])] == got[i]
        else:
            assert got[i] == alone[i], i


@pytest.mark.parametrize("limits", [dict(max_batch=1), dict(max_batch=3, max_batch_rows=1), dict(max_batch_rows=7)])
def test_batch_caps_change_nothing_but_the_grouping(limits):
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                             logits_shift=False, block_size=4, **limits)
    reqs = _requests(8)
    alone = [_run(eng, p, kw) for p, kw in reqs]
    f0, s0, _ = eng.batch_stats
    assert _concurrently(eng, reqs) == alone
    f1, s1, _ = eng.batch_stats
    if limits.get("max_batch") == 1 or limits.get("max_batch_rows") == 1:
        assert s1 - s0 == f1 - f0  # one stream step per forward
    assert eng.batching == (limits.get("max_batch", 16), limits.get("max_batch_rows", 1024))


@pytest.mark.parametrize("kw,msg", [
    (dict(max_batch=0), "max_batch must be an integer between 1 and 4096, got 0"),
    (dict(max_batch=-3), "max_batch must be an integer between 1 and 4096, got -3"),
    (dict(max_batch_rows=2 ** 40), "max_batch_rows must be an integer between 1 and 1048576"),
    (dict(max_batch="8"), "max_batch must be an integer, got '8'"),
    (dict(max_batch=True), "max_batch must be an integer, got True"),
])
def test_bad_batch_caps_are_clear_errors(sdar, kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        sdar.set_batching(**kw)
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), **kw)
    assert sdar.batching == (16, 1024)
