"""The prefix cache: a request whose tokens begin as an earlier request's prompt (or prompt and answer) starts
from their K/V and prefills only the rest. Checked against the same engine with the cache off (prefix_cache=0):
the same tokens, the same forward passes and log-probabilities within 1e-5, in every decoding mode and family
where the cache is on; off (no lookup at all) where it would not be exact."""
import functools
import json
import os
import random

import pytest

import mbd_rs
from conftest import copy_model, parity_dir, run_child

PAGE = 32  # tokens a page holds at least (a page is whole blocks of the grid)


@functools.lru_cache(maxsize=None)
def engines(model, **load):
    """(with the cache, without) for a fixture model."""
    path = parity_dir(model) if model != "tiny" else mbd_rs.DEFAULT_MODEL
    kw = dict(load, mask_token_id=3) if model != "tiny" else load
    return mbd_rs.Engine.load(path, **kw), mbd_rs.Engine.load(path, prefix_cache=0, **kw)


def _engines(model, load):
    return engines(model, **dict(load))


def prompts(seed, vocab=300):
    """A base prompt (70 tokens: two whole pages and a partial block), the base and five more (hits two pages), its
    first 33 tokens (a hit that ends inside the prompt's last page and block), and an unrelated prompt (no hit)."""
    r = random.Random(seed)
    base = [r.randrange(4, vocab) for _ in range(70)]
    return base, [base + [r.randrange(4, vocab) for _ in range(5)], base[:33], [r.randrange(4, vocab) for _ in range(40)]]


def same(a, b, what):
    assert a.token_ids == b.token_ids, what
    assert a.finish_reason == b.finish_reason, what
    assert a.usage.forward_passes == b.usage.forward_passes, what
    if a.logprobs:
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5, what


def check_mode(on, off, kw, seed, expect_hits=True):
    """The base prompt cold, then the others (and the base followed by its own answer): equal with the cache off."""
    on.clear_prefix_cache()
    base, rest = prompts(seed, on.info.vocab_size)
    a = on.generate(base, max_tokens=24, **kw)
    same(a, off.generate(base, max_tokens=24, **kw), ("cold", kw))
    assert a.usage.cached_tokens == 0
    follow = base + a.token_ids[:20] + [5, 6, 7]  # the next turn: the answer, then new tokens
    for i, p in enumerate(rest + [follow]):
        x, y = on.generate(p, max_tokens=16, **kw), off.generate(p, max_tokens=16, **kw)
        same(x, y, (i, kw))
        assert y.usage.cached_tokens == 0
        if expect_hits and i == 0:
            assert x.usage.cached_tokens >= 2 * PAGE - 4, (kw, x.usage)
    return a


# SDAR's layout on the random-weight checkpoints (block-causal over blocks of 4 aligned at 0, unshifted), and
# Fast-dLLM v2's (shifted: the carry row)
SDAR = (("attention", "block_causal"), ("block_size", 4), ("logits_shift", False))
FDV2 = (("attention", "block_causal"), ("block_size", 4), ("logits_shift", True))


BLOCK_CAUSAL = [
    {},
    {"block_size": 1},  # autoregressive
    {"block_add_threshold": 1.0},  # one block at a time (semi-AR)
    {"sub_block_size": 2},
    {"speculative": "s2d2"},
    {"acceptance": "bacd"},
    {"acceptance": "credit"},
    {"acceptance": "dus"},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 0.8, "top_k": 20, "seed": 5, "block_size": 8},
]


@pytest.mark.parametrize("kw", BLOCK_CAUSAL, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("model,load", [
    ("qwen3_headdim_gqa", SDAR),
    ("qwen2_gqa_tied", SDAR),
    ("qwen3moe_top2_norm", SDAR),
    ("qwen2_gqa_tied", FDV2),
    ("qwen3moe_top2_norm", FDV2),
    ("tiny", ()),
])
def test_a_hit_decodes_as_a_cold_request_in_every_block_causal_mode(model, load, kw):
    on, off = _engines(model, load)
    assert on.info.prefix_cache == "exact"
    check_mode(on, off, dict(kw, logprobs=2) if "speculative" not in kw else kw, seed=len(str(kw)) + len(model))


@pytest.mark.parametrize("model", ["qwen3_headdim_gqa", "qwen3moe_top2_norm"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "seed": 2}], ids=["greedy", "sampled"])
def test_a_hit_decodes_as_a_cold_request_with_isd(model, kw):
    """I-DLM's layout (causal, shifted) decoded with ISD: pages of 32 positions, a hit up to the prompt's last
    token (the pending one is forwarded by the first step)."""
    on, off = _engines(model, (("attention", "causal"), ("logits_shift", True)))
    check_mode(on, off, dict(kw, speculative="isd", isd_stride=3), seed=9)


HYBRID_MODES = [{}, {"block_size": 1}, {"block_add_threshold": 1.0}, {"acceptance": "credit"},
                {"temperature": 0.8, "seed": 11}]


@pytest.mark.parametrize("kw", HYBRID_MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("load", [SDAR, ()], ids=["block_causal", "causal"])
def test_a_hybrid_hit_restores_the_recurrent_state(load, kw):
    """Qwen3.5 (Gated DeltaNet and softmax layers): a hit ends where a page kept the recurrent states (the
    prompt's last page boundary, every 512th position), restores them and decodes as a cold request."""
    on, off = _engines("qwen35_hybrid", load)
    assert on.info.prefix_cache == "exact, with recurrent-state snapshots"
    check_mode(on, off, dict(kw, logprobs=2), seed=21)
    s = on.prefix_cache_stats()
    assert s.hits > 0 and s.pages > 0


def test_a_long_hybrid_prompt_keeps_states_every_512_positions(tmp_path):
    d = copy_model(parity_dir("qwen35_hybrid"), tmp_path / "long", lambda c: c.update(max_position_embeddings=2048))
    load = dict(SDAR, mask_token_id=3)
    on, off = mbd_rs.Engine.load(str(d), **load), mbd_rs.Engine.load(str(d), prefix_cache=0, **load)
    r = random.Random(5)
    long = [r.randrange(4, on.info.vocab_size) for _ in range(1100)]
    on.generate(long, max_tokens=4)
    # a prompt sharing the first 700 tokens: the states kept at 512 (not at its own last page) are the hit
    p = long[:700] + [7, 8, 9]
    a, b = on.generate(p, max_tokens=8, logprobs=1), off.generate(p, max_tokens=8, logprobs=1)
    same(a, b, "hybrid 700")
    assert a.usage.cached_tokens == 512


def test_tccf_and_the_trained_model_hit_too():
    on, off = _engines("tiny", ())
    check_mode(on, off, {"tccf": True, "tccf_trigger": "!", "tccf_answer_block_size": 1}, seed=3)
    msgs = [{"role": "system", "content": "You sort numbers. " * 6}, {"role": "user", "content": "sort 7 2 9 4 1"}]
    cold = off.chat(msgs, max_tokens=24)
    on.clear_prefix_cache()
    first, again = on.chat(msgs, max_tokens=24), on.chat(msgs, max_tokens=24)
    assert first.token_ids == again.token_ids == cold.token_ids
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == (first.usage.prompt_tokens // PAGE) * PAGE


@pytest.mark.parametrize("model,load,why", [
    ("qwen2_gqa_tied", (("attention", "full"), ("logits_shift", True)), "full attention"),
    ("qwen2_gqa_tied", SDAR + (("alignment", "prompt"),), "blocks aligned at the prompt's end"),
])
def test_where_it_would_not_be_exact_the_cache_is_not_used(model, load, why):
    on, off = _engines(model, load)
    assert on.info.prefix_cache.startswith("off: "), on.info.prefix_cache
    on.clear_prefix_cache()
    base, rest = prompts(4, on.info.vocab_size)
    for p in [base, base, rest[0]]:
        a, b = on.generate(p, max_tokens=12), off.generate(p, max_tokens=12)
        assert a.token_ids == b.token_ids and a.usage.cached_tokens == 0, why
    s = on.prefix_cache_stats()
    assert s.lookups == 0 and s.pages == 0, (why, s)


def test_use_cache_false_and_the_approximate_caches_neither_look_up_nor_insert():
    on, _ = _engines("tiny", ())
    on.clear_prefix_cache()
    before = on.prefix_cache_stats()
    base, _ = prompts(1, on.info.vocab_size)
    for kw in [{"use_cache": False}, {"use_cache": False}]:
        assert on.generate(base, max_tokens=8, **kw).usage.cached_tokens == 0
    after = on.prefix_cache_stats()
    assert (after.lookups, after.pages) == (before.lookups, 0)


def test_a_salt_keeps_requests_apart():
    """Only requests with the same cache_salt share pages: a salted request never hits what an unsalted (or
    differently salted) one cached, and the other way round."""
    on, off = _engines("tiny", ())
    on.clear_prefix_cache()
    base, _ = prompts(2, on.info.vocab_size)
    on.generate(base, max_tokens=4)
    assert on.generate(base, max_tokens=4, cache_salt="alice").usage.cached_tokens == 0
    assert on.generate(base, max_tokens=4, cache_salt="bob").usage.cached_tokens == 0
    a = on.generate(base, max_tokens=4, cache_salt="alice")
    assert a.usage.cached_tokens == 2 * PAGE and a.token_ids == off.generate(base, max_tokens=4).token_ids
    assert on.generate(base, max_tokens=4).usage.cached_tokens == 2 * PAGE
    with pytest.raises(mbd_rs.InvalidRequestError, match="cache_salt is text of more than 256 characters"):
        on.generate(base, max_tokens=4, cache_salt="x" * 257)


def test_clear_and_the_counters():
    on, _ = _engines("tiny", ())
    on.clear_prefix_cache()
    s0 = on.prefix_cache_stats()
    assert s0.pages == 0 and s0.bytes == 0 and s0.capacity_bytes > 0
    base, _ = prompts(3, on.info.vocab_size)
    on.generate(base, max_tokens=4)
    s1 = on.prefix_cache_stats()
    assert s1.pages >= 2 and s1.bytes > 0 and s1.lookups == s0.lookups + 1 and s1.hits == s0.hits
    assert on.generate(base, max_tokens=4).usage.cached_tokens == 2 * PAGE
    s2 = on.prefix_cache_stats()
    assert s2.hits == s1.hits + 1 and s2.hit_tokens == s1.hit_tokens + 2 * PAGE and 0 < s2.hit_rate <= 1
    on.clear_prefix_cache()
    assert on.prefix_cache_stats().pages == 0
    assert on.generate(base, max_tokens=4).usage.cached_tokens == 0
    # a generation's pages are in the cache once its result is back (not inserted later, behind a clear)
    for _ in range(30):
        on.generate(base, max_tokens=4)
        assert on.prefix_cache_stats().pages >= 2
        on.clear_prefix_cache()
        assert on.generate(base, max_tokens=4).usage.cached_tokens == 0
        on.clear_prefix_cache()


def test_a_tiny_cap_evicts_and_every_output_stays_exact():
    """A cap of three pages of the tiny model: requests over many distinct prefixes evict least recently used
    pages, the bytes held never pass the cap, and every output equals the cold one."""
    _, off = _engines("tiny", ())
    page_bytes = 2 * off.info.num_layers * off.info.num_key_value_heads * off.info.head_dim * 4 * PAGE
    cap = 3 * page_bytes
    on = mbd_rs.Engine.load(mbd_rs.DEFAULT_MODEL, prefix_cache=cap)
    r = random.Random(0)
    shared = [r.randrange(4, 100) for _ in range(PAGE)]
    hits = 0
    for i in range(12):
        p = (shared if i % 2 else []) + [r.randrange(4, 100) for _ in range(40)]
        a = on.generate(p, max_tokens=6)
        assert a.token_ids == off.generate(p, max_tokens=6).token_ids
        s = on.prefix_cache_stats()
        assert s.bytes <= cap and s.capacity_bytes == cap, s
        hits += a.usage.cached_tokens > 0
    s = on.prefix_cache_stats()
    assert s.evicted_pages > 0 and hits >= 4, (s, hits)


def test_concurrent_streams_share_a_prefix_and_equal_their_lone_cold_runs():
    on, off = _engines("qwen3_headdim_gqa", SDAR)
    on.clear_prefix_cache()
    base, _ = prompts(8, on.info.vocab_size)
    on.generate(base, max_tokens=4)
    ps = [base + [10 + i, 20 + i] for i in range(4)]
    streams = [on.stream(p, max_tokens=12) for p in ps]
    outs = [s.result() for s in streams]
    for p, o in zip(ps, outs):
        assert o.usage.cached_tokens == 2 * PAGE
        cold = off.generate(p, max_tokens=12)
        assert o.token_ids == cold.token_ids and o.usage.forward_passes == cold.usage.forward_passes


def test_a_running_request_shares_its_prompt_at_once():
    """The prompt's pages go into the cache after its first step: a request that begins the same way, sent while
    the first still decodes (it cannot have finished: its reader has not read past its first chunk, so the
    scheduler holds it a few outputs on), starts from them; both equal their cold runs."""
    on, off = _engines("qwen3_headdim_gqa", SDAR)
    on.clear_prefix_cache()
    base, _ = prompts(9, on.info.vocab_size)
    kw = dict(max_tokens=64, threshold=1.0, early_stop=False)  # one token per forward: 64 steps
    with on.stream(base + [11], **kw) as first:
        head = next(first)
        other = on.generate(base + [12, 13], max_tokens=8)
        assert first.finish_reason is None and other.usage.cached_tokens == 2 * PAGE, other.usage
        rest = [head] + list(first)
    cold = off.generate(base + [11], **kw)
    assert [t for c in rest for t in c.token_ids] == cold.token_ids
    cold_other = off.generate(base + [12, 13], max_tokens=8)
    assert other.token_ids == cold_other.token_ids and other.usage.forward_passes == cold_other.usage.forward_passes


def test_load_option_is_checked():
    with pytest.raises(mbd_rs.InvalidRequestError, match="prefix_cache"):
        mbd_rs.Engine.load(mbd_rs.DEFAULT_MODEL, prefix_cache=-1)


FLOOD = """
import json, random, sys
import mbd_rs
eng = mbd_rs.Engine.load(sys.argv[1], prefix_cache=int(sys.argv[2]))
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
rng = random.Random(0)
def one():  # a distinct 256-token prompt: 8 pages of its own, none shared
    eng.generate([rng.randrange(5, 95) for _ in range(256)], max_tokens=1)
for _ in range(40):
    one()
before = rss_mb()
for _ in range(int(sys.argv[3])):
    one()
s = eng.prefix_cache_stats()
print(json.dumps({"growth_mb": rss_mb() - before, "bytes": s.bytes, "evicted": s.evicted_pages}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_a_flood_of_distinct_prefixes_keeps_memory_flat(long_context_model):
    """200 requests with distinct 256-token prompts, in a fresh process: under an 8 MB cap the cache evicts and the
    process's RSS grows by less than the cap (measured: ~1.5 MB; the same flood with no cap to speak of grows it by
    ~186 MB, 210 MB of pages held)."""
    cap = 8 << 20
    r = run_child(FLOOD, long_context_model, cap, 200, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bytes"] <= cap and out["evicted"] > 1000, out
    assert out["growth_mb"] < 8, out


@pytest.mark.parametrize("model,load", [("qwen3_headdim_gqa", SDAR), ("qwen35_hybrid", SDAR)], ids=["dense", "hybrid"])
def test_a_saved_cache_loads_into_another_engine_and_its_hits_are_exact(tmp_path, model, load):
    """save_prefix_cache, then load_prefix_cache into a fresh engine of the same model: its requests hit the loaded
    pages and decode as cold requests (the cache off)."""
    path, kw = parity_dir(model), dict(dict(load), mask_token_id=3)
    a = mbd_rs.Engine.load(path, **kw)
    base, (longer, _, _) = prompts(31, a.info.vocab_size)
    a.generate(base, max_tokens=8)
    f = tmp_path / "prompts.safetensors"
    n = a.save_prefix_cache(f)
    assert n == a.prefix_cache_stats().pages > 0 and f.stat().st_size > 0
    b = mbd_rs.Engine.load(path, **kw)
    assert b.load_prefix_cache(str(f)) == n and b.prefix_cache_stats().pages == n
    assert b.load_prefix_cache(f) == 0  # held already
    off = _engines(model, load)[1]
    x, y = b.generate(longer, max_tokens=12, logprobs=2), off.generate(longer, max_tokens=12, logprobs=2)
    same(x, y, "loaded")
    assert x.usage.cached_tokens >= PAGE


def test_a_loaded_cache_stays_within_the_cap(tmp_path):
    on = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, **dict(SDAR))
    r = random.Random(4)
    for _ in range(3):
        on.generate([r.randrange(4, 300) for _ in range(96)], max_tokens=4)
    f = tmp_path / "c.safetensors"
    n = on.save_prefix_cache(f)
    per_page = on.prefix_cache_stats().bytes // n
    small = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, prefix_cache=4 * per_page,
                               **dict(SDAR))
    got = small.load_prefix_cache(f)
    s = small.prefix_cache_stats()
    assert 0 < got < n and s.pages == got and s.bytes <= 4 * per_page


def test_a_prefix_cache_file_of_another_engine_or_no_such_file_is_refused(tmp_path):
    a = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, **dict(SDAR))
    a.generate(list(range(4, 80)), max_tokens=4)
    f = tmp_path / "a.safetensors"
    a.save_prefix_cache(f)
    # another model: other K/V
    other = mbd_rs.Engine.load(parity_dir("qwen3_bias_tied"), mask_token_id=3, **dict(SDAR))
    with pytest.raises(mbd_rs.InvalidRequestError, match="another model, engine build or load options"):
        other.load_prefix_cache(f)
    # the same weights quantized: other arithmetic, other K/V
    q = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, quantize="q8_0", **dict(SDAR))
    with pytest.raises(mbd_rs.InvalidRequestError, match="another model"):
        q.load_prefix_cache(f)
    with pytest.raises(FileNotFoundError):
        a.load_prefix_cache(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(mbd_rs.InvalidRequestError, match="junk.safetensors"):
        a.load_prefix_cache(junk)
    # a safetensors file that is not a prefix cache: its weights
    with pytest.raises(mbd_rs.InvalidRequestError, match="mbd_rs.prefix_cache"):
        a.load_prefix_cache(os.path.join(parity_dir("qwen3_headdim_gqa"), "model.safetensors"))


def test_a_tampered_prefix_cache_file_is_refused_with_the_reason(tmp_path):
    """The tree in the metadata and every tensor are checked against this model's cache: a wrong shape, a token
    outside the vocabulary, a parent that is not an earlier page get specific errors (the fingerprint matches)."""
    from safetensors.numpy import load_file, save_file
    a = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, **dict(SDAR))
    a.generate(list(range(4, 80)), max_tokens=4)
    f = tmp_path / "a.safetensors"
    a.save_prefix_cache(f)
    from safetensors import safe_open
    with safe_open(str(f), "np") as h:
        meta = json.loads(h.metadata()["mbd_rs.prefix_cache"])
    tensors = load_file(str(f))

    def write(m, t=tensors):
        g = tmp_path / "t.safetensors"
        save_file(t, str(g), metadata={"mbd_rs.prefix_cache": json.dumps(m)})
        return g

    bad_token = json.loads(json.dumps(meta))
    bad_token["pages"][0]["tokens"][0] = 10 ** 6
    with pytest.raises(mbd_rs.InvalidRequestError, match="outside the vocabulary"):
        a.load_prefix_cache(write(bad_token))
    bad_parent = json.loads(json.dumps(meta))
    bad_parent["pages"][0]["parent"] = 0
    with pytest.raises(mbd_rs.InvalidRequestError, match="not an earlier page"):
        a.load_prefix_cache(write(bad_parent))
    cut = dict(tensors)
    cut["0.k.0"] = cut["0.k.0"][:, :3]
    with pytest.raises(mbd_rs.InvalidRequestError, match="0.k.0"):
        a.load_prefix_cache(write(meta, cut))
    with pytest.raises(mbd_rs.InvalidRequestError, match="format"):
        a.load_prefix_cache(write(dict(meta, format="something else")))
