"""The OpenAI-compatible server, run for real on 127.0.0.1 with uvicorn and driven by the official openai
client, on the embedded mbd-tiny model."""
import json
import re
import threading
import time

import pytest

import mbd_rs

openai = pytest.importorskip("openai", reason="openai client not installed (pip install openai)")
uvicorn = pytest.importorskip("uvicorn", reason="server extra not installed (pip install 'mbd-rs[server]')")
httpx = pytest.importorskip("httpx")
from conftest import Server  # noqa: E402

KEY = "sk-test-123"
MSG = [{"role": "user", "content": "reverse a b c d e"}]
GREEDY = dict(max_tokens=24)


@pytest.fixture(scope="module")
def engine():
    return mbd_rs.Engine.load()


@pytest.fixture(scope="module")
def long_engine(long_context_model):
    return mbd_rs.Engine.load(long_context_model)


# A stream that outlasts any test in any build (on the long-context model): a 2,000-token prompt recomputed at
# every one of 256 steps (no cache), one token a step; a debug build takes about a second a step.
SLOW_CHAT = {"messages": [{"role": "user", "content": "sort 3 1 2 " * 180}], "stream": True, "max_tokens": 256,
             "use_cache": False, "threshold": 0.0, "block_add_threshold": 1.0, "block_size": 1, "early_stop": False}


@pytest.fixture(scope="module")
def server(engine):
    s = Server(engine, api_key=KEY, max_concurrency=2, max_queue=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["mbd-tiny"]
    r = httpx.get(server.base + "/health", headers={"Authorization": f"Bearer {KEY}"})
    h = r.json()
    assert h["status"] == "ok" and (h["capacity"], h["batch"], h["queue"]) == (3, 2, 1)


def test_chat_non_streaming_matches_engine(client, engine):
    want = engine.chat(MSG, **GREEDY)
    r = client.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == want.usage.completion_tokens
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.usage.total_tokens == want.usage.prompt_tokens + want.usage.completion_tokens


def test_usage_says_how_much_of_the_prompt_the_prefix_cache_gave(client, engine):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, then the whole 32-token pages
    the first request left in the engine's prefix cache; the answer is the same."""
    msgs = [{"role": "system", "content": "You sort numbers. " * 5}, {"role": "user", "content": "sort 4 2 9"}]
    engine.clear_prefix_cache()
    first, again = (client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=8, temperature=0)
                    for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 32 * 32 > 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_chat_streaming(client, engine):
    want = engine.chat(MSG, **GREEDY)
    chunks = list(client.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    fins = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert fins == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    # streamed in pieces: outputs that pile up while a reader is busy reach it merged (so a slow moment of the
    # machine can deliver an untraced stream in one piece); traced forwards are never merged, one event each
    traced = list(client.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=24, stream=True,
                                                 extra_body={"trace": True}))
    assert "".join(c.choices[0].delta.content or "" for c in traced if c.choices) == want.text
    assert len([c for c in traced if c.choices and c.choices[0].delta.content]) > 1


def _steps(server, **body):
    """The mbd_step events of a streamed chat request with trace="canvas"."""
    body = dict({"messages": MSG, "max_tokens": 24, "stream": True, "trace": "canvas"}, **body)
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return [e["mbd_step"] for e in events if "mbd_step" in e]


def test_canvas_steps_mark_the_end_of_the_text(server, engine):
    """The web view's step events: the canvas as token texts (None: masked) and `end`, the offset of its first
    end-of-text token (the model's EOS ids, or the request's stop_token_ids), None before one is decoded."""
    want = [c.step for c in engine.stream_chat(MSG, max_tokens=24, trace="canvas") if c.step]
    steps = _steps(server)
    assert [s["index"] for s in steps] == [w.index for w in want]
    eos = set(engine.info.eos_token_ids)
    for s, w in zip(steps, want):
        assert s["canvas"] == [None if t < 0 else engine.detokenize([t], skip_special_tokens=False)
                               for t in w.canvas]
        ends = [i for i, t in enumerate(w.canvas) if t in eos]
        assert s["end"] == w.end == (ends[0] if ends else None)
    assert steps[0]["end"] is None or len(steps) == 1
    assert steps[-1]["end"] is not None and steps[-1]["end"] == len(engine.chat(MSG, max_tokens=24).token_ids)
    # a stop token id ends the text where it is first decoded
    ids = engine.chat(MSG, max_tokens=24).token_ids
    stop = ids[3]
    last = _steps(server, stop_token_ids=[stop])[-1]
    assert last["end"] == ids.index(stop)


def test_completion_streaming_and_not(client, engine):
    prompt = engine.apply_chat_template([{"role": "user", "content": "sort 4 1 3"}])
    want = engine.generate(prompt, **GREEDY)
    r = client.completions.create(model="mbd-tiny", prompt=prompt, max_tokens=24)
    assert r.choices[0].text == want.text
    s = client.completions.create(model="mbd-tiny", prompt=prompt, max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in s) == want.text


def test_stop_strings_and_extensions(client, engine):
    full = engine.chat([{"role": "user", "content": "hello Ada"}], max_tokens=40)
    stop = full.text[3:5]
    r = client.chat.completions.create(model="mbd-tiny", messages=[{"role": "user", "content": "hello Ada"}],
                                       max_tokens=40, stop=[stop], extra_body={"block_size": 4, "threshold": 0.5})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full.text[: full.text.index(stop)]


def test_s2d2_through_the_server(client, engine):
    msgs = [{"role": "user", "content": "sort 4 1 3"}]
    body = {"speculative": "s2d2", "verify_policy": "hysteresis", "verify_hysteresis": [1, -5]}
    want = engine.chat(msgs, max_tokens=24, **body)
    r = client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=24, extra_body=body)
    assert r.choices[0].message.content == want.text
    u = r.usage.model_extra  # the extension fields of the usage object
    assert u["verifications"] == want.usage.verifications and u["drafts_accepted"] == want.usage.drafts_accepted
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mbd-tiny", messages=msgs, extra_body={"verify_hysteresis": [1]})
    assert "speculative" in e.value.body["message"]
    # ISD reaches the plan too: the embedded model is block-causal, which ISD refuses
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mbd-tiny", messages=msgs, extra_body={"speculative": "isd"})
    assert "attention='causal'" in e.value.body["message"]


@pytest.mark.parametrize("body", [{"acceptance": "dus"}, {"acceptance": "bacd", "bacd_lower": 0.3},
                                  {"acceptance": "credit", "credit_alpha": 1.5, "threshold": 0.8}],
                         ids=["dus", "bacd", "credit"])
def test_2026_acceptance_rules_through_the_server(client, engine, body):
    msgs = [{"role": "user", "content": "reverse a b c"}]
    want = engine.chat(msgs, max_tokens=24, **body)
    r = client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=24, extra_body=body)
    assert r.choices[0].message.content == want.text
    assert r.usage.model_extra["forward_passes"] == want.usage.forward_passes


def test_invalid_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mbd-tiny", messages=MSG, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=100000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mbd-tiny", messages=MSG, extra_body={"threshold": -2})
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MSG)
    assert e.value.body["code"] == "model_not_found"


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _active(server):
    return httpx.get(server.base + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()["active"]


@pytest.fixture
def long_server(long_engine):
    """The module's `server` (capacity 3) over the long-context model."""
    s = Server(long_engine, api_key=KEY, max_concurrency=2, max_queue=1)
    yield s
    s.stop()


@pytest.fixture
def long_bserver(long_engine):
    """The module's `bserver` (capacity 6) over the long-context model."""
    s = Server(long_engine, api_key=KEY, max_concurrency=4, max_queue=2)
    yield s
    s.stop()


def test_busy_then_disconnect_frees_slot(long_server):
    hdr = {"Authorization": f"Bearer {KEY}"}
    server = long_server
    long_body = SLOW_CHAT
    clients = [httpx.Client(timeout=30) for _ in range(3)]  # 2 batched, 1 queued
    streams = []
    try:
        for c in clients:
            cm = c.stream("POST", server.base + "/v1/chat/completions", json=long_body, headers=hdr)
            resp = cm.__enter__()
            assert resp.status_code == 200
            lines = resp.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)  # the role chunk: the generation holds its slot
            streams.append((cm, resp, lines))
        r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG}, headers=hdr)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    finally:
        for cm, resp, _ in streams:
            resp.close()
            cm.__exit__(None, None, None)
        for c in clients:
            c.close()
    deadline = time.time() + 20
    while _active(server) != 0:
        assert time.time() < deadline, "disconnected streams did not free their slots"
        time.sleep(0.05)
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8}, headers=hdr)
    assert r.status_code == 200


def test_eight_concurrent_clients_match_one(engine):
    s = Server(engine, max_concurrency=8)
    try:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=60)
        prompts = [[{"role": "user", "content": p}] for p in
                   ["sort 3 1 2", "reverse x y z", "add 12+30", "repeat ab 3", "count a in abcab", "hello Ada",
                    "sort 9 8 7 1", "reverse q w e r"]]
        alone = [c.chat.completions.create(model="mbd-tiny", messages=m, max_tokens=24).choices[0].message.content
                 for m in prompts]
        got = [None] * 8

        def work(i):
            got[i] = c.chat.completions.create(model="mbd-tiny", messages=prompts[i], max_tokens=24).choices[0].message.content

        f0, s0, _ = engine.batch_stats
        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        f1, s1, _ = engine.batch_stats
        assert got == alone
        assert s1 - s0 > f1 - f0  # the engine batched them: fewer forwards than stream steps
    finally:
        s.stop()


def test_health_is_open_and_requests_are_logged(server, caplog):
    import logging
    assert httpx.get(server.base + "/health").status_code == 200  # no API key needed
    with caplog.at_level(logging.INFO, logger="mbd_rs.server"):
        r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200
        n = r.json()["usage"]["completion_tokens"]
        for _ in range(100):
            if any("/v1/chat/completions" in m for m in caplog.messages):
                break
            time.sleep(0.02)
    line = next(m for m in caplog.messages if "/v1/chat/completions" in m)
    assert f"POST /v1/chat/completions 200 tokens={n} " in line and re.search(r"ms id=[0-9a-f]{32}$", line)


# --- several choices per request (n, prompt lists) and the tokenizer routes -------------------------------------

HDR = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def bserver(engine):
    s = Server(engine, api_key=KEY, max_concurrency=4, max_queue=2)  # capacity 6
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bclient(bserver):
    return openai.OpenAI(base_url=bserver.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _prompt(engine, content):
    return engine.apply_chat_template([{"role": "user", "content": content}])


def _wait_idle(server):
    deadline = time.time() + 20
    while _active(server) != 0:
        assert time.time() < deadline, f"slots still held: {_active(server)}"
        time.sleep(0.05)


def test_n_greedy_choices_match_one_request(bclient, bserver, engine):
    prompt = _prompt(engine, "sort 4 1 3")
    want = engine.generate(prompt, max_tokens=24)
    f0, s0, _ = engine.batch_stats
    r = bclient.completions.create(model="mbd-tiny", prompt=prompt, max_tokens=24, n=3)
    f1, s1, _ = engine.batch_stats
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [want.text] * 3
    assert [c.finish_reason for c in r.choices] == [want.finish_reason] * 3
    assert r.usage.prompt_tokens == want.usage.prompt_tokens  # the prompt is counted once
    assert r.usage.completion_tokens == 3 * want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert s1 - s0 > f1 - f0  # the three choices shared forwards
    chat = engine.chat(MSG, max_tokens=24)
    rc = bclient.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=24, n=3)
    assert [(c.index, c.message.content) for c in rc.choices] == [(i, chat.text) for i in range(3)]
    assert _active(bserver) == 0


def test_n_seeded_sampling_is_seed_plus_index(bclient, bserver, engine):
    kw = dict(max_tokens=16, temperature=1.5, raw=True)  # /v1/completions completes the text as it is
    # a seed whose neighbour samples differently, so a wrong per-choice seed would show
    seed = next(s for s in range(1, 50)
                if engine.generate("hello", seed=s, **kw).text != engine.generate("hello", seed=s + 1, **kw).text)
    want = [engine.generate("hello", seed=seed + i, **kw).text for i in range(2)]
    kw.pop("raw")
    r = bclient.completions.create(model="mbd-tiny", prompt="hello", n=2, seed=seed, **kw)
    assert [c.text for c in r.choices] == want
    again = bclient.completions.create(model="mbd-tiny", prompt="hello", n=2, seed=seed, **kw)
    assert [c.text for c in again.choices] == want  # reproducible
    single = bclient.completions.create(model="mbd-tiny", prompt="hello", seed=seed + 1, **kw)
    assert single.choices[0].text == want[1]
    chat_want = [engine.chat(MSG, seed=seed + i, **kw).text for i in range(2)]
    rc = bclient.chat.completions.create(model="mbd-tiny", messages=MSG, n=2, seed=seed, **kw)
    assert [c.message.content for c in rc.choices] == chat_want


def test_prompt_lists(bclient, bserver, engine):
    ids = [engine.tokenize(_prompt(engine, c)) for c in ("sort 3 1 2", "reverse x y z", "hello Ada")]
    want = [engine.generate(p, max_tokens=24) for p in ids]
    r = bclient.completions.create(model="mbd-tiny", prompt=ids, max_tokens=24)
    assert [(c.index, c.text) for c in r.choices] == [(i, w.text) for i, w in enumerate(want)]
    assert r.usage.prompt_tokens == sum(len(p) for p in ids)
    assert r.usage.completion_tokens == sum(w.usage.completion_tokens for w in want)
    # strings, with n=2: choice index = prompt_index * n + i
    texts = [_prompt(engine, c) for c in ("sort 3 1 2", "hello Ada")]
    want_s = [engine.generate(t, max_tokens=24).text for t in texts]
    r2 = bclient.completions.create(model="mbd-tiny", prompt=texts, max_tokens=24, n=2)
    assert [(c.index, c.text) for c in r2.choices] == [(i, want_s[i // 2]) for i in range(4)]
    # a single token-id list is one prompt
    r3 = bclient.completions.create(model="mbd-tiny", prompt=ids[1], max_tokens=24)
    assert [c.text for c in r3.choices] == [want[1].text]
    assert _active(bserver) == 0


def test_streaming_several_choices(bclient, bserver, engine):
    texts = [_prompt(engine, c) for c in ("sort 9 8 7 1", "repeat ab 3")]
    full = bclient.completions.create(model="mbd-tiny", prompt=texts, max_tokens=24, n=2)
    chunks = list(bclient.completions.create(model="mbd-tiny", prompt=texts, max_tokens=24, n=2, stream=True,
                                             stream_options={"include_usage": True}))
    got, fins = {}, {}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        ch = c.choices[0]
        got[ch.index] = got.get(ch.index, "") + ch.text
        if ch.finish_reason:
            assert ch.index not in fins  # one finish per choice
            fins[ch.index] = ch.finish_reason
    assert got == {c.index: c.text for c in full.choices}
    assert fins == {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # chat: a role chunk per choice, then deltas per index
    want = engine.chat(MSG, max_tokens=24).text
    cs = list(bclient.chat.completions.create(model="mbd-tiny", messages=MSG, max_tokens=24, n=2, stream=True))
    assert sorted(c.choices[0].index for c in cs if c.choices[0].delta.role == "assistant") == [0, 1]
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in cs if c.choices[0].index == i) == want
    assert sorted(c.choices[0].index for c in cs if c.choices[0].finish_reason) == [0, 1]
    _wait_idle(bserver)


def test_choices_take_slots_and_disconnect_frees_them(long_bserver):
    bserver = long_bserver
    long_body = dict(SLOW_CHAT, n=2)
    url = bserver.base + "/v1/chat/completions"
    r = httpx.post(url, json={"messages": MSG, "n": 7}, headers=HDR)  # 7 choices > capacity 6: never runnable
    assert r.status_code == 400 and "at most 6" in r.json()["error"]["message"]
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url, json=long_body, headers=HDR) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = set()
            while len(seen) < 2:  # both choices are running
                line = next(lines)
                if line.startswith("data: {"):
                    seen |= {ch["index"] for ch in json.loads(line[6:])["choices"] if ch["delta"].get("content")}
            assert _active(bserver) == 2
            r = httpx.post(url, json={"messages": MSG, "n": 5}, headers=HDR)  # 5 > the 4 free slots
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
            assert _active(bserver) == 2  # a refused request takes nothing
    _wait_idle(bserver)  # the client left mid-stream: both generations cancelled, both slots back
    r = httpx.post(url, json={"messages": MSG, "n": 6, "max_tokens": 8}, headers=HDR, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 6
    _wait_idle(bserver)


def test_bad_n_and_prompts(bserver):
    url = bserver.base + "/v1/completions"
    for body, word in [({"prompt": "a", "n": 0}, "n must"), ({"prompt": "a", "n": 17}, "n must"),
                       ({"prompt": "a", "n": "2"}, "n must"), ({"prompt": "a", "n": True}, "n must"),
                       ({"prompt": "a", "n": 1.5}, "n must"), ({"prompt": []}, "empty"),
                       ({"prompt": [1, "a"]}, "mix"), ({"prompt": [[1, 2], "x"]}, "mix"),
                       ({"prompt": [[1, 2], []]}, "prompt[1]"), ({"prompt": [[1, True]]}, "prompt[0]"),
                       ({"prompt": [["a"]]}, "prompt[0]"), ({"prompt": {"a": 1}}, "prompt must"),
                       ({"prompt": ["a", "b"], "n": 4}, "8 choices")]:
        r = httpx.post(url, json=body, headers=HDR)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error" and word in r.json()["error"]["message"], body
    r = httpx.post(url, json={"prompt": [[1, 2], [10 ** 9]], "max_tokens": 4}, headers=HDR)
    assert r.status_code == 400  # the engine refuses the second prompt's id after the first one started
    r = httpx.post(bserver.base + "/v1/chat/completions", json={"messages": MSG, "n": 0}, headers=HDR)
    assert r.status_code == 400
    assert _active(bserver) == 0


def test_tokenizer_routes(bserver, engine):
    b = bserver.base
    text = "hello Ada <|im_end|> 12+30"
    for special in (True, False):
        r = httpx.post(b + "/tokenize", json={"prompt": text, "add_special_tokens": special}, headers=HDR).json()
        want = engine.tokenize(text, add_special_tokens=special)
        assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == engine.info.max_context
    ids = r["tokens"]
    for skip in (False, True):
        d = httpx.post(b + "/detokenize", json={"tokens": ids, "skip_special_tokens": skip}, headers=HDR).json()
        assert d["prompt"] == engine.detokenize(ids, skip_special_tokens=skip)
    d = httpx.post(b + "/detokenize", json={"tokens": ids}, headers=HDR).json()
    assert d["prompt"] == engine.detokenize(ids, skip_special_tokens=False)  # default: specials kept, as vLLM
    strs = httpx.post(b + "/tokenize", json={"prompt": text, "return_token_strs": True}, headers=HDR).json()
    assert strs["token_strs"] == [engine.detokenize([t], skip_special_tokens=False) for t in strs["tokens"]]
    m = httpx.post(b + "/tokenize", json={"messages": MSG}, headers=HDR).json()
    assert m["tokens"] == engine.tokenize(engine.apply_chat_template(MSG), add_special_tokens=False)
    # lm-eval (local-completions with --apply_chat_template) sends the messages as "prompt"
    lm = httpx.post(b + "/tokenize", json={"prompt": MSG, "add_special_tokens": False}, headers=HDR).json()
    assert lm["tokens"] == m["tokens"]
    # what lm-evaluation-harness's RemoteTokenizer reads
    info = httpx.get(b + "/tokenizer_info", headers=HDR).json()
    assert {"eos_token", "bos_token", "pad_token", "chat_template"} <= set(info)
    eos = httpx.post(b + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     headers=HDR).json()["tokens"]
    assert eos[0] in engine.info.eos_token_ids and info["max_model_len"] == engine.info.max_context
    cfg = json.load(open(engine.info.path + "/tokenizer_config.json"))
    assert info["chat_template"] == cfg["chat_template"] and info["pad_token"] == cfg["pad_token"]
    # errors and auth
    for path, body in [("/tokenize", {"prompt": 5}), ("/tokenize", {}), ("/tokenize", {"prompt": "a", "x": 1}),
                       ("/detokenize", {"tokens": ["a"]}), ("/detokenize", {"tokens": [10 ** 9]})]:
        assert httpx.post(b + path, json=body, headers=HDR).status_code == 400, (path, body)
    assert httpx.post(b + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(b + "/tokenizer_info").status_code == 401


# ------------------------------------------------------------------------------------------ log-probabilities


def test_completion_logprobs_match_engine(bclient, engine):
    """logprobs=k on /v1/completions: the engine's per-token log-probabilities in the legacy shape, streamed or
    not, for every choice of a prompt list."""
    want = engine.generate("sort: 3 1 2 =", max_tokens=8, logprobs=2, raw=True)
    r = bclient.completions.create(model="mbd-tiny", prompt=["sort: 3 1 2 =", "sort: 3 1 2 ="], max_tokens=8,
                                   logprobs=2)
    for ch in r.choices:
        lp = ch.logprobs
        # every decided token, the EOS that ended the completion included (when one did)
        assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
        assert lp.tokens == [engine.detokenize([x.token_id], skip_special_tokens=False) for x in want.logprobs]
        assert "".join(lp.tokens[:len(want.token_ids)]) == ch.text == want.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for top, x in zip(lp.top_logprobs, want.logprobs):
            assert list(top.values()) == pytest.approx([b for _, b in x.top_logprobs], abs=1e-5)
    streamed = bclient.completions.create(model="mbd-tiny", prompt="sort: 3 1 2 =", max_tokens=8, logprobs=2,
                                          stream=True)
    got = [v for c in streamed for v in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert got == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)


def test_echo_scores_the_prompt(bclient, engine):
    """echo + logprobs + max_tokens 0/1 (what lm-evaluation-harness's loglikelihood sends): the prompt's text and
    its tokens' left-to-right scores (None for the first), then the one generated token."""
    ids = engine.tokenize("sort: 3 1 2 = 1 2 3")
    scores = engine.prompt_logprobs(ids, logprobs=1)
    r = bclient.completions.create(model="mbd-tiny", prompt=[ids, ids[:5]], max_tokens=0, echo=True, logprobs=1)
    full, short = r.choices
    assert full.text == engine.detokenize(ids, skip_special_tokens=False) and full.finish_reason == "length"
    assert full.logprobs.token_logprobs[0] is None and full.logprobs.top_logprobs[0] is None
    assert full.logprobs.token_logprobs[1:] == pytest.approx([s.logprob for s in scores[1:]], abs=1e-5)
    assert short.logprobs.token_logprobs[1:] == pytest.approx([s.logprob for s in scores[1:5]], abs=1e-5)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids) + 5, 0)
    one = bclient.completions.create(model="mbd-tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1)
    gen = engine.generate(ids, max_tokens=1, logprobs=1)
    c = one.choices[0]
    assert c.text == full.text + gen.text
    assert len(c.logprobs.token_logprobs) == len(ids) + 1
    assert c.logprobs.token_logprobs[-1] == pytest.approx(gen.logprobs[0].logprob, abs=1e-5)
    assert c.logprobs.text_offset[len(ids)] == len(full.text)
    # echo of a text prompt, streamed: the prompt comes first
    chunks = list(bclient.completions.create(model="mbd-tiny", prompt="sort: 3 1 2 =", max_tokens=3, echo=True,
                                             stream=True))
    assert chunks[0].choices[0].text == "sort: 3 1 2 ="
    assert "".join(c.choices[0].text for c in chunks) == "sort: 3 1 2 =" + engine.generate(
        "sort: 3 1 2 =", max_tokens=3, raw=True).text


def test_chat_logprobs(bclient, engine):
    """Chat content entries are the content's tokens (the engine's trailing EOS entry is left out)."""
    want = engine.chat(MSG, logprobs=3, **GREEDY)
    assert want.finish_reason == "stop"
    r = bclient.chat.completions.create(model="mbd-tiny", messages=MSG, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    want_lp = [x.logprob for x in want.logprobs[:len(want.token_ids)]]
    assert [c.logprob for c in content] == pytest.approx(want_lp, abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    streamed = bclient.chat.completions.create(model="mbd-tiny", messages=MSG, logprobs=True, stream=True, **GREEDY)
    got = [x.logprob for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert got == pytest.approx(want_lp, abs=1e-5)
    plain = bclient.chat.completions.create(model="mbd-tiny", messages=MSG, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_echo_logprobs_refused_for_full_attention():
    """Full-attention models have no left-to-right likelihood: echo with logprobs is a clear 400 (echo alone and
    generation logprobs still work)."""
    import os
    eng = mbd_rs.Engine.load(os.path.join(os.path.dirname(__file__), "fixtures", "parity", "qwen3_headdim_gqa"),
                             device="cpu", mask_token_id=3, attention="full", logits_shift=True, eos_token_ids=[0])
    srv = Server(eng)
    try:
        post = lambda body: httpx.post(srv.base + "/v1/completions", json=body, timeout=60)  # noqa: E731
        r = post({"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 400 and "needs block-causal or causal attention" in r.json()["error"]["message"]
        assert post({"prompt": [5, 6, 7], "max_tokens": 2, "echo": True}).status_code == 200
        r = post({"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1, "early_stop": False})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
        assert srv.app.state.slots.active == 0
    finally:
        srv.stop()
