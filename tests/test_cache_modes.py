"""The `cache` parameter: exact / none / prefix / dual. Parity of the prefix cache with d3LLM's schedule over
transformers is in test_decode_parity.py (the prefix_* cases); here: what each mode forwards, the limits of the
approximation, and bad combinations."""
import functools

import pytest

import mbd_rs
from conftest import parity_dir


@functools.lru_cache(maxsize=None)
def dream_like():
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="full", logits_shift=True,
                              block_size=4, eos_token_ids=[0])


PROMPT = [(7 * i + 11) % 250 + 4 for i in range(40)]
KW = dict(max_tokens=24, threshold=2.9, early_stop=False)


def test_none_is_the_default_for_full_attention():
    eng = dream_like()
    a, b = eng.generate(PROMPT, **KW), eng.generate(PROMPT, cache="none", **KW)
    assert a.token_ids == b.token_ids and a.usage.forward_passes == b.usage.forward_passes
    # every step forwards the whole canvas
    assert a.usage.positions_forwarded == a.usage.forward_passes * (len(PROMPT) + 24)


def test_prefix_cache_forwards_less():
    eng = dream_like()
    none = eng.generate(PROMPT, **KW).usage
    prefix = eng.generate(PROMPT, cache="prefix", **KW).usage
    # the prompt is cached at the first step (delay 1 from step 0), so later steps skip it, except refreshes
    assert prefix.positions_forwarded < none.positions_forwarded * prefix.forward_passes / none.forward_passes


def test_a_delay_longer_than_the_generation_is_no_cache():
    """A block is cached only after waiting out the delay; while one waits every step recomputes the canvas.
    With a delay no step reaches, prefix decoding is exactly decoding without a cache."""
    eng = dream_like()
    none = eng.generate(PROMPT, cache="none", **KW)
    never = eng.generate(PROMPT, cache="prefix", cache_delay=10 ** 6, **KW)
    assert never.token_ids == none.token_ids
    assert never.usage.forward_passes == none.usage.forward_passes
    assert never.usage.positions_forwarded == none.usage.positions_forwarded


def test_periodic_refresh_recomputes():
    eng = dream_like()
    a = eng.generate(PROMPT, cache="prefix", **KW).usage
    b = eng.generate(PROMPT, cache="prefix", refresh_interval=1, **KW).usage
    # a refresh is due at every step: every step recomputes the whole canvas, except the steps that cache a
    # block (they forward from the cache's end and take priority, as in d3LLM)
    full = b.forward_passes * (len(PROMPT) + 24)
    assert a.positions_forwarded < b.positions_forwarded < full


def test_prefix_window_created_stops_at_the_last_created_block():
    """prefix_window='created': no forward reaches past the last created block, so with small blocks every step
    forwards fewer positions than with the canvas window (token equality with d3LLM-style semantics is checked
    against the reference decoder in test_decode_parity.py, the prefix_*_created cases)."""
    eng = dream_like()
    canvas = eng.generate(PROMPT, cache="prefix", **KW)
    created = eng.generate(PROMPT, cache="prefix", prefix_window="created", **KW)
    explicit = eng.generate(PROMPT, cache="prefix", prefix_window="canvas", **KW)
    assert explicit.token_ids == canvas.token_ids
    usage = lambda u: (u.forward_passes, u.positions_forwarded)  # noqa: E731
    assert usage(explicit.usage) == usage(canvas.usage)
    per_step = lambda u: u.positions_forwarded / u.forward_passes  # noqa: E731
    assert per_step(created.usage) < per_step(canvas.usage)
    assert created.usage.positions_forwarded <= created.usage.forward_passes * (len(PROMPT) + 24)


def test_dual_cache_forwards_the_region_between_rebuilds():
    eng = dream_like()
    none = eng.generate(PROMPT, cache="none", **KW)
    dual = eng.generate(PROMPT, cache="dual", block_add_threshold=1.0, **KW)
    single = eng.generate(PROMPT, cache="none", block_add_threshold=1.0, **KW)
    u = dual.usage
    # single block of 4: a rebuild (whole canvas) when a block starts, then steps of at most 4 positions
    assert u.positions_forwarded < single.usage.positions_forwarded
    assert len(dual.token_ids) == len(none.token_ids) == 24


def test_exact_stays_the_default_where_kv_are_final():
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                             logits_shift=False, block_size=4)
    a, b = eng.generate(PROMPT, **KW), eng.generate(PROMPT, cache="exact", **KW)
    assert a.token_ids == b.token_ids and a.usage.positions_forwarded == b.usage.positions_forwarded
    c = eng.generate(PROMPT, cache="none", **KW)
    assert c.token_ids == a.token_ids and c.usage.positions_forwarded > a.usage.positions_forwarded


def test_exact_causal_steps_forward_only_the_rows_they_use():
    """A causal shifted model decoding one token per step: the first step's token is predicted by the prefill's last
    row (no forward of its own), each later step forwards the one position whose row predicts the next (the masks
    after it change nothing a causal row sees); the tokens and forward counts are those of decoding without a
    cache."""
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="causal", logits_shift=True)
    ar = dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0, early_stop=False)
    a, b = eng.generate(PROMPT, max_tokens=12, **ar), eng.generate(PROMPT, max_tokens=12, cache="none", **ar)
    assert a.token_ids == b.token_ids and a.usage.forward_passes == b.usage.forward_passes == 12
    assert a.usage.positions_forwarded == 11
    one = eng.generate(PROMPT, max_tokens=1, **ar)
    assert one.token_ids == a.token_ids[:1] and one.usage.positions_forwarded == 0
    # a step predicting several positions forwards up to the last row it reads
    blocks = eng.generate(PROMPT, max_tokens=12, block_size=4, early_stop=False)
    none = eng.generate(PROMPT, max_tokens=12, block_size=4, early_stop=False, cache="none")
    assert blocks.token_ids == none.token_ids


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
def test_a_short_prompt_and_the_first_window_are_one_forward(shift):
    """The prompt's last prefill chunk, when short, is forwarded with the first window: a one-token answer to a
    40-token prompt takes one forward in all (the scheduler's count), the tokens and forward passes of decoding
    without a cache; positions_forwarded counts the window's positions only (the mask row; none when shifted)."""
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                             logits_shift=shift, block_size=4, prefix_cache=0)
    before = eng.batch_stats[0]
    one = eng.generate(PROMPT, max_tokens=1)
    assert eng.batch_stats[0] - before == 1
    assert one.usage.positions_forwarded == (0 if shift else 1) and one.usage.prefill_ms > 0
    for kw in ({}, {"block_size": 1}, {"speculative": "s2d2"}):
        a, b = eng.generate(PROMPT, **KW, **kw), eng.generate(PROMPT, cache="none", **KW, **kw)
        assert a.token_ids == b.token_ids and a.usage.forward_passes == b.usage.forward_passes, kw


@pytest.mark.parametrize("full,kw,msg", [
    (True, dict(cache="exact"), "no K/V is ever final"),
    (False, dict(cache="prefix"), "cached exactly"),
    (False, dict(cache="dual"), "cached exactly"),
    (True, dict(cache="dual", use_cache=False), "use_cache=False contradicts cache='dual'"),
    (True, dict(cache="dual", cache_delay=1), "cache_delay only with cache='prefix'"),
    (True, dict(cache="prefix", use_cache=False), "use_cache=False contradicts cache='prefix'"),
    (True, dict(cache_delay=2), "cache_delay only with cache='prefix'"),
    (True, dict(cache="none", refresh_interval=5), "refresh_interval only with cache='prefix'"),
    (True, dict(cache="prefix", refresh_interval=0), "refresh_interval must be >= 1"),
    (True, dict(cache="prefix", cache_delay=-1), "cache_delay must be >= 0"),
    (True, dict(prefix_window="created"), "prefix_window only with cache='prefix'"),
    (True, dict(cache="prefix", prefix_window="block"), "prefix_window must be"),
    (True, dict(cache="dual-ish"), "cache must be"),
    (True, dict(cache=True), "cache must be a string"),
])
def test_bad_combinations_are_clear_errors(full, kw, msg):
    eng = dream_like() if full else mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3,
                                                       attention="block_causal", logits_shift=False)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        eng.generate([5, 6, 7], max_tokens=4, **kw)
