"""The generation API: streaming semantics, parameters, cancellation, threads, chat templates."""
import threading
import time

import pytest

import mbd_rs
from conftest import parity_dir


@pytest.fixture(scope="module")
def eng():
    # SDAR-like: block-causal, unshifted, mask id 3 (the fixture tokenizer's <|mask|>).
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                              logits_shift=False, block_size=4)


PROMPT = [255, 192, 155, 83, 95, 16]
KW = dict(max_tokens=24, threshold=3.0, acceptance="entropy", block_add_threshold=0.1)


def test_stream_concatenation_equals_generate(eng):
    chunks = list(eng.stream(PROMPT, **KW))
    done = eng.generate(PROMPT, **KW)
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert done.text == eng.detokenize(done.token_ids)
    assert chunks[-1].finish_reason == done.finish_reason == "length"
    assert chunks[-1].usage is not None and all(c.usage is None for c in chunks[:-1])
    # streaming is token by token: more chunks than blocks' worth would give (with trace every forward is a chunk;
    # without it a reader that falls behind gets the tokens that piled up joined in one chunk)
    traced = list(eng.stream(PROMPT, trace=True, **KW))
    assert len([c for c in traced if c.token_ids]) > 24 // 4
    assert [t for c in traced for t in c.token_ids] == done.token_ids


def test_cache_is_used_and_exact(eng):
    a = eng.generate(PROMPT, **KW)
    b = eng.generate(PROMPT, use_cache=False, **KW)
    assert a.token_ids == b.token_ids and a.usage.forward_passes == b.usage.forward_passes
    assert a.usage.positions_forwarded < b.usage.positions_forwarded / 2


def test_usage_numbers(eng):
    u = eng.generate(PROMPT, **KW).usage
    assert u.prompt_tokens == len(PROMPT) and u.completion_tokens == 24
    assert u.tokens_per_forward == pytest.approx(24 / u.forward_passes)
    assert 0 < u.ttft_ms <= u.decode_ms and u.tokens_per_second > 0
    # the head (vocabulary product and row statistics) is timed inside the steps
    assert 0 < u.head_ms < u.decode_ms


def test_trace_events(eng):
    steps = [c.step for c in eng.stream(PROMPT, trace="canvas", **KW) if c.step]
    assert [s.index for s in steps] == list(range(1, len(steps) + 1))
    assert sum(len(s.decoded) for s in steps) == 24
    assert steps[0].blocks[0][2] in ("fully_activated", "completed") and steps[-1].blocks[-1][2] == "completed"
    assert steps[0].canvas.count(-1) == 24 - len(steps[0].decoded) and -1 not in steps[-1].canvas


def test_stop_string_and_stop_tokens(eng):
    full = eng.generate(PROMPT, **KW)
    stop = full.text[5:8]
    cut = eng.generate(PROMPT, stop=[stop], **KW)
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    chunks = list(eng.stream(PROMPT, stop=stop, **KW))
    assert "".join(c.text for c in chunks) == cut.text
    tok = full.token_ids[3]
    st = eng.generate(PROMPT, stop_token_ids=[tok], **KW)
    assert st.finish_reason == "stop" and st.token_ids == full.token_ids[: full.token_ids.index(tok)]


def test_sampling_is_seeded(eng):
    a = eng.generate(PROMPT, temperature=0.8, top_p=0.9, top_k=20, seed=7, **KW)
    b = eng.generate(PROMPT, temperature=0.8, top_p=0.9, top_k=20, seed=7, **KW)
    c = eng.generate(PROMPT, temperature=0.8, top_p=0.9, top_k=20, seed=8, **KW)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_cancel_and_close(eng):
    s = eng.stream(PROMPT, max_tokens=64, threshold=0.0)
    next(s)
    s.cancel()
    rest = list(s)
    assert rest[-1].finish_reason == "cancelled" and len(s.token_ids) < 64
    with eng.stream(PROMPT, max_tokens=64) as s2:
        next(s2)
    assert list(s2) == []


def test_threads_give_same_outputs(eng):
    want = eng.generate(PROMPT, **KW).token_ids
    got = [None] * 4

    def work(i):
        got[i] = eng.generate(PROMPT, **KW).token_ids

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert got == [want] * 4


@pytest.mark.parametrize("kw,msg", [
    (dict(threshold=-1), "threshold must be >= 0, got -1"),
    (dict(block_add_threshold=1.5), r"block_add_threshold must be in \[0, 1\], got 1.5"),
    (dict(decoded_token_threshold=-0.1), r"decoded_token_threshold must be in \[0, 1\]"),
    (dict(block_size=0), "block_size must be >= 1, got 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(acceptance="greedy"), "acceptance must be 'entropy', 'confidence', 'eb', 'bacd', 'credit' or 'dus', got 'greedy'"),
    (dict(forced_progress="all"), "forced_progress must be 'first' or 'every'"),
    (dict(max_tokens=1000), r"maximum context is 256 tokens; requested 1006 \(6 prompt \+ 1000 completion\)"),
])
def test_invalid_parameters(eng, kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        eng.generate(PROMPT, **kw)


def test_context_length_is_its_own_error(eng):
    with pytest.raises(mbd_rs.ContextLengthError):
        eng.generate(PROMPT, max_tokens=1000)


def test_unknown_parameter_is_type_error(eng):
    with pytest.raises(TypeError, match="valid parameters"):
        eng.generate(PROMPT, max_new_tokens=3)


def test_empty_prompt_and_bad_ids(eng):
    with pytest.raises(mbd_rs.InvalidRequestError, match="prompt is empty"):
        eng.generate("")
    with pytest.raises(mbd_rs.InvalidRequestError, match="out of range"):
        eng.generate([1, 99999])


def test_mask_token_from_tokenizer_or_refused(model_copy):
    assert mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied")).info.mask_token_id == 3  # <|mask|> in tokenizer.json
    d = model_copy("qwen2_gqa_tied")
    tj = d / "tokenizer.json"
    tj.write_text(tj.read_text().replace("<|mask|>", "<|msk|>"))
    eng = mbd_rs.Engine.load(d)
    assert eng.info.mask_token_id is None
    with pytest.raises(mbd_rs.InvalidRequestError, match="has no mask token id; pass mask_token_id"):
        eng.generate([5, 6, 7], max_tokens=3)
    assert mbd_rs.Engine.load(d, mask_token_id=3).generate([5, 6, 7], max_tokens=3).usage.completion_tokens <= 3


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template(model_copy):
    d = model_copy()
    (d / "chat_template.jinja").write_text(CHATML)
    eng = mbd_rs.Engine.load(d, mask_token_id=3, attention="block_causal", logits_shift=False, block_size=4)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 1 2"}]
    text = eng.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsort 3 1 2<|im_end|>\n<|im_start|>assistant\n"
    ids = eng.tokenize(text, add_special_tokens=False)
    assert ids.count(eng.tokenize("<|im_start|>", add_special_tokens=False)[0]) == 3  # special tokens parsed
    c = eng.chat(msgs, max_tokens=8)
    assert c.usage.prompt_tokens == len(ids)
    with pytest.raises(mbd_rs.InvalidRequestError, match="messes|messages"):
        eng.chat([{"role": "user"}])


def test_no_chat_template_is_clear(eng):
    with pytest.raises(mbd_rs.InvalidRequestError, match="has no chat template"):
        eng.chat([{"role": "user", "content": "hi"}])


def test_chat_by_default_where_the_model_has_a_template():
    """A text prompt is the user's message on a model with a chat template: the embedded model answers
    a task as its chat does; raw=True, a templated prompt and token ids complete the text as it is."""
    eng = mbd_rs.Engine.load()
    msg = [{"role": "user", "content": "sort 3 1 2"}]
    chat = eng.chat(msg, max_tokens=12)
    assert chat.text == "1 2 3" and eng.chats("sort 3 1 2")
    assert eng.generate("sort 3 1 2", max_tokens=12).token_ids == chat.token_ids
    assert "".join(c.text for c in eng.stream("sort 3 1 2", max_tokens=12)) == chat.text
    raw = eng.generate("sort 3 1 2", max_tokens=12, raw=True)
    assert raw.token_ids == eng.generate(eng.tokenize("sort 3 1 2"), max_tokens=12).token_ids != chat.token_ids
    templated = eng.apply_chat_template(msg)
    assert not eng.chats(templated) and eng.generate(templated, max_tokens=12).token_ids == chat.token_ids
    assert not eng.chats([5, 6]) and not eng.chats("sort 3 1 2", raw=True)


def test_no_template_no_chat():
    eng = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), device="cpu", mask_token_id=3)
    assert eng.info.chat_template is None and not eng.chats("abc")
    assert eng.generate("abc", max_tokens=5).token_ids == eng.generate(eng.tokenize("abc"), max_tokens=5).token_ids


def test_trace_and_usage_agree_on_tokens_per_forward():
    """One number, one meaning: the last step's tokens_per_forward is usage's (completion tokens per forward); the
    decoder's positions per forward, which count the end of text and the fill after it, have their own name."""
    eng = mbd_rs.Engine.load()
    s = eng.stream_chat([{"role": "user", "content": "sort 5 3 8 1 9 2"}], max_tokens=32, trace=True)
    steps = [ch.step for ch in s if ch.step is not None]
    u = s.usage
    assert steps and steps[-1].tokens_per_forward == pytest.approx(u.tokens_per_forward)
    assert steps[-1].positions_per_forward > u.tokens_per_forward  # the end of text is a position, not a token
    assert all(a.tokens_per_forward * a.index <= b.tokens_per_forward * b.index for a, b in zip(steps, steps[1:]))


def _progress_seen(stream):
    """Every distinct prompt_progress read (polled, without reading the stream) until the prompt is done."""
    seen = [stream.prompt_progress]
    while seen[-1][0] < seen[-1][1]:
        p = stream.prompt_progress
        if p != seen[-1]:
            seen.append(p)
        time.sleep(0.0005)
    return seen


def test_prompt_progress_follows_the_prefill(long_context_model):
    eng = mbd_rs.Engine.load(long_context_model)
    prompt = [5 + (7 * i) % 90 for i in range(1200)]  # 1200 tokens: prefill chunks of 512
    with eng.stream(prompt, max_tokens=4) as s:
        seen = _progress_seen(s)
        comp = s.result()
    assert all(t == 1200 for _, t in seen), seen
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == 1200, seen
    assert any(0 < d < 1200 for d in done), seen  # a chunk boundary seen between the start and the end
    assert s.prompt_progress == (1200, 1200)
    # again: the prefix cache's positions count as computed from the first forward on
    with eng.stream(prompt, max_tokens=4) as s:
        seen = _progress_seen(s)
        again = s.result()
    assert again.token_ids == comp.token_ids and again.usage.cached_tokens > 0
    assert all(d == 0 or d >= again.usage.cached_tokens for d, _ in seen), (seen, again.usage.cached_tokens)
