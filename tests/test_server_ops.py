"""What a server gives the people who run it, on a live server: /metrics in Prometheus' format (parsed by
prometheus_client's own parser) whose counters move as requests run, X-Request-Id, OpenAI error JSON for unknown
routes and methods (read by the openai client), /v1/models/{id}, system_fingerprint, /health's real prompt limit,
and SSE keep-alive comments while a stream waits."""
import threading
import time

import pytest

import mbd_rs

openai = pytest.importorskip("openai", reason="openai client not installed (pip install openai)")
pytest.importorskip("uvicorn", reason="server extra not installed (pip install 'mbd-rs[server]')")
httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")
from conftest import Server  # noqa: E402

# the live server of tests/test_server.py, one per module (its fixtures, imported)
from test_server import KEY, client, engine, server  # noqa: E402,F401  (fixtures)

AUTH = {"Authorization": f"Bearer {KEY}"}


def scrape(server):
    r = httpx.get(server.base + "/metrics")  # open, as /health is: scrapers carry no key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in parser.text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_as_requests_run(server, client, engine):
    msgs = [{"role": "user", "content": "sort 7 2 9"}]
    before = scrape(server)
    r = client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    httpx.post(server.base + "/v1/chat/completions", headers=AUTH, json={"messages": msgs, "max_tokens": -1})
    after = scrape(server)
    route = "/v1/chat/completions"
    assert value(after, "mbd_requests_total", route=route, status="200") - \
        value(before, "mbd_requests_total", route=route, status="200") == 2
    assert value(after, "mbd_requests_total", route=route, status="400") - \
        value(before, "mbd_requests_total", route=route, status="400") == 1
    done = r.usage.completion_tokens + chunks[-1].usage.completion_tokens
    assert value(after, "mbd_completion_tokens_total") - value(before, "mbd_completion_tokens_total") == done
    assert value(after, "mbd_prompt_tokens_total") - value(before, "mbd_prompt_tokens_total") == \
        2 * r.usage.prompt_tokens
    assert value(after, "mbd_generations_total", finish_reason="stop") - \
        value(before, "mbd_generations_total", finish_reason="stop") == 2
    # one first token per generation; the other tokens each an inter-token latency
    assert value(after, "mbd_time_to_first_token_seconds_count") - \
        value(before, "mbd_time_to_first_token_seconds_count") == 2
    assert value(after, "mbd_inter_token_latency_seconds_count") - \
        value(before, "mbd_inter_token_latency_seconds_count") == done - 2
    assert value(after, "mbd_tokens_per_forward_count") - value(before, "mbd_tokens_per_forward_count") == 2
    assert value(after, "mbd_engine_forwards_total") > value(before, "mbd_engine_forwards_total")
    assert value(after, "mbd_generation_slots") == 3 and value(after, "mbd_active_generations") == 0
    # the engine's prefix cache is on by default: its bytes are there
    assert ("mbd_prefix_cache_bytes", ()) in after
    # a scanner's paths are one label, not one each
    for p in ("/a", "/b", "/c"):
        httpx.get(server.base + p)
    assert value(scrape(server), "mbd_requests_total", route="other", status="404") >= 3


def test_request_id_is_echoed_or_made(server):
    r = httpx.get(server.base + "/v1/models", headers={**AUTH, "X-Request-Id": "trace-42/abc"})
    assert r.headers["x-request-id"] == "trace-42/abc"
    made = httpx.get(server.base + "/v1/models", headers=AUTH).headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    for bad in ("x" * 129, "two words"):
        got = httpx.get(server.base + "/health", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert got != bad and len(got) == 32
    # errors carry one too
    assert len(httpx.get(server.base + "/nope").headers["x-request-id"]) == 32


def test_unknown_routes_and_methods_are_openai_errors(server, client):
    with pytest.raises(openai.NotFoundError, match="no route /v1/embeddings"):
        client.embeddings.create(model="mbd-tiny", input="hi")
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist; this server serves 'mbd-tiny'"):
        client.models.retrieve("gpt-4")
    r = httpx.get(server.base + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == "GET is not allowed on /v1/chat/completions; it takes POST"
    r = httpx.delete(server.base + "/v1/models", headers=AUTH)
    assert r.status_code == 405 and "it takes GET" in r.json()["error"]["message"]


def test_models_retrieve_and_health_limit(server, client, engine):
    m = client.models.retrieve("mbd-tiny")
    assert m.id == "mbd-tiny" and m.owned_by == "mbd-rs"
    assert httpx.get(server.base + "/v1/models/mbd-tiny").status_code == 401  # the key, as /v1/models
    h = httpx.get(server.base + "/health").json()
    # the real limit: the model's context (256 positions) minus one completion token, not the server's 8192 cap
    assert engine.info.max_context == 256
    assert (h["max_prompt_tokens"], h["max_positions"]) == (255, 256)


def test_system_fingerprint_names_build_and_weights(server, client, engine, tmp_path):
    msgs = [{"role": "user", "content": "sort 3 1 2"}]
    a = client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="mbd-tiny", messages=msgs, max_tokens=8, stream=True))
    c = client.completions.create(model="mbd-tiny", prompt="sort 3 1 2", max_tokens=8)
    fp = a.system_fingerprint
    assert fp.startswith("fp_") and len(fp) == 19
    assert {ch.system_fingerprint for ch in chunks} == {fp} and c.system_fingerprint == fp
    from conftest import copy_model
    from mbd_rs.server.metrics import fingerprint
    assert fingerprint(engine.info.path) == fp
    # one byte of the weights changed: another fingerprint
    d = copy_model(mbd_rs.DEFAULT_MODEL, tmp_path / "m")
    w = next(p for p in d.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 1
    w.write_bytes(bytes(raw))
    assert fingerprint(str(d)) != fp


def test_a_waiting_stream_gets_keep_alives(long_context_model):
    """One place in the batch, held by a long generation: a streaming request waits in the queue and receives a
    ': keep-alive' comment every `keepalive` seconds (no event would come otherwise); once the long one goes, it
    runs, and its answer is the engine's."""
    eng = mbd_rs.Engine.load(long_context_model)
    s = Server(eng, max_concurrency=1, max_queue=1, keepalive=0.2)
    try:
        slow = {"messages": [{"role": "user", "content": "sort 3 1 2 " * 180}], "stream": True, "max_tokens": 256,
                "use_cache": False, "threshold": 0.0, "block_add_threshold": 1.0, "block_size": 1,
                "early_stop": False}
        started, stop = threading.Event(), threading.Event()

        def hold():
            with httpx.stream("POST", s.base + "/v1/chat/completions", json=slow, timeout=120) as r:
                for line in r.iter_lines():
                    if '"content"' in line:
                        started.set()
                    if stop.is_set():
                        return

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        assert started.wait(60)
        alive, text, t0 = [], "", time.monotonic()
        body = {"prompt": "sort 3 1 2", "stream": True, "max_tokens": 8}
        with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == ": keep-alive":
                    alive.append(time.monotonic())
                    if time.monotonic() - t0 > 1.5:
                        stop.set()  # the long one's client leaves: its generation is cancelled
                elif line.startswith("data: {"):
                    import json
                    text += json.loads(line[6:])["choices"][0]["text"]
        t.join(60)
        assert len(alive) >= 5
        gaps = [b - a for a, b in zip(alive, alive[1:])]
        assert max(gaps) < 1.0, gaps  # every 0.2 s, with slack for a loaded machine
        assert text == eng.generate("sort 3 1 2", max_tokens=8, raw=True).text
    finally:
        s.stop()


def test_unsupported_fields_are_refused_by_name(server, client):
    with pytest.raises(openai.BadRequestError, match="store is not supported by this server") as e:
        client.chat.completions.create(model="mbd-tiny", messages=[{"role": "user", "content": "hi"}], store=True)
    assert e.value.param == "store"


def test_content_parts_are_joined_text(server, client, engine):
    """OpenAI's content parts (the openai SDK's typed messages, LangChain's content blocks): text parts joined with
    newlines, as one string content; other parts and a speaker's name are refused, naming them."""
    parts = [{"type": "text", "text": "sort 3 1"}, {"type": "text", "text": "2"}]
    want = engine.chat([{"role": "user", "content": "sort 3 1\n2"}], max_tokens=12)
    assert engine.chat([{"role": "user", "content": parts}], max_tokens=12).token_ids == want.token_ids
    r = client.chat.completions.create(model="mbd-tiny", messages=[{"role": "user", "content": parts}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text
    sys_parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                 {"role": "user", "content": "sort 3 1 2"}]
    assert client.chat.completions.create(model="mbd-tiny", messages=sys_parts, max_tokens=12).choices[0] \
        .message.content == engine.chat([{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "sort 3 1 2"}], max_tokens=12).text
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].content\\[1\\] is a \"image_url\" part; this "
                                                     "model reads text parts only"):
        client.chat.completions.create(model="mbd-tiny", messages=[{"role": "user", "content": [parts[0], image]}])
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].name is not supported"):
        client.chat.completions.create(model="mbd-tiny", messages=[{"role": "user", "content": "hi", "name": "ann"}])
    with pytest.raises(mbd_rs.InvalidRequestError, match="content\\[0\\] must be a part like"):
        engine.chat([{"role": "user", "content": ["just a string"]}])
    # the tokenizer route gives the same ids as the generation runs on
    ids = httpx.post(server.base + "/tokenize", headers=AUTH, json={"messages": [{"role": "user", "content": parts}]})
    assert ids.json()["tokens"] == engine.chat_ids([{"role": "user", "content": "sort 3 1\n2"}])


def test_openapi_schema_agrees_with_the_server(server, client, engine):
    """/openapi.json is open, names every route, carries every engine parameter of the registry as a body field, and
    what the jsonschema package finds valid or not under its chat body schema is what the server accepts or refuses."""
    jsonschema = pytest.importorskip("jsonschema")
    r = httpx.get(server.base + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"] == mbd_rs.__version__
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health", "/metrics",
            "/tokenize", "/detokenize", "/tokenizer_info"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        missing = set(mbd_rs.GENERATION_PARAMS) - {"logprobs"} - set(schemas[name]["properties"])
        assert not missing, f"{name} lacks the engine parameters {sorted(missing)}"

    def valid(body):
        v = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ChatCompletionRequest",
                                             "components": doc["components"]})
        return v.is_valid(body)

    msgs = [{"role": "user", "content": [{"type": "text", "text": "sort 3 1 2"}]}]
    good = {"model": "mbd-tiny", "messages": msgs, "max_completion_tokens": 4, "temperature": 0,
            "presence_penalty": 0.5, "block_size": 4, "stream_options": None}
    bad = [{"messages": msgs, "colour": "red"}, {"messages": msgs, "n": 17}, {"messages": []},
           {"messages": msgs, "stream": "yes"}, {"messages": msgs, "logprobs": 3}, {"messages": msgs, "user": 5},
           {"messages": msgs, "stream": True, "stream_options": {"include_usage": True, "x": 1}}]
    assert valid(good)
    got = httpx.post(server.base + "/v1/chat/completions", json=good, headers=AUTH, timeout=60)
    assert got.status_code == 200, got.text
    for body in bad:
        assert not valid(body), body
        got = httpx.post(server.base + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["message"], (body, got.text)


def test_answers_match_the_served_response_schemas(server, engine):
    """What the server answers (plain and streamed, both routes, log-probabilities, echo, trace, usage, refusals)
    is valid under the response schemas /openapi.json serves, checked by the jsonschema package."""
    import json
    jsonschema = pytest.importorskip("jsonschema")
    doc = httpx.get(server.base + "/openapi.json").json()

    def check(name, obj):
        v = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(obj)]
        assert not errors, (name, errors, obj)

    def post(route, body):
        return httpx.post(server.base + route, json=body, headers=AUTH, timeout=60)

    def events(route, body):
        out = []
        with httpx.stream("POST", server.base + route, json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(json.loads(line[6:]))
        assert out
        return out

    msgs = [{"role": "user", "content": "sort 3 1 2"}]
    chat, comp = "/v1/chat/completions", "/v1/completions"
    check("ChatCompletion", post(chat, {"messages": msgs, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
                                        "n": 2}).json())
    check("Completion", post(comp, {"prompt": "sort 3 1 2", "max_tokens": 8, "logprobs": 2, "echo": True}).json())
    check("Completion", post(comp, {"prompt": ["sort 3 1", "sort 2 1"], "max_tokens": 0, "echo": True}).json())
    for e in events(chat, {"messages": msgs, "max_tokens": 8, "stream": True, "logprobs": True, "trace": "canvas",
                           "stream_options": {"include_usage": True}}):
        check("ChatCompletionChunk", e)
    for e in events(comp, {"prompt": "sort 3 1 2", "max_tokens": 8, "stream": True, "logprobs": 1, "echo": True,
                           "stream_options": {"include_usage": True, "include_progress": True}}):
        check("CompletionChunk", e)
    for r in (post(chat, {"messages": []}), post(comp, {"prompt": "x", "n": 99}), post("/v1/nothing", {}),
              httpx.get(server.base + chat)):
        assert r.status_code >= 400
        check("ErrorResponse", r.json())


def test_progress_events_follow_a_long_prefill(long_context_model, monkeypatch):
    """stream_options.include_progress: while the prompt's prefill runs, events with "mbd_progress" (no choices),
    one each time it moved; the answer is the engine's. Without it, no such event."""
    import json

    from mbd_rs.server import app
    monkeypatch.setattr(app, "PROGRESS_EVERY", 0.02)
    eng = mbd_rs.Engine.load(long_context_model)
    s = Server(eng, keepalive=0.2)
    prompt = [5 + (7 * i) % 90 for i in range(6000)]
    try:
        def run(opts):
            body = {"prompt": prompt, "stream": True, "max_tokens": 4, "stream_options": opts}
            progress, text = [], ""
            with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        if "mbd_progress" in d:
                            assert d["choices"] == []
                            progress.append(d["mbd_progress"])
                        else:
                            text += d["choices"][0]["text"]
            return progress, text

        eng.clear_prefix_cache()
        progress, text = run({"include_progress": True})
        assert text == eng.generate(prompt, max_tokens=4).text
        assert len(progress) >= 2, progress
        assert all(len(p) == 1 and p[0]["index"] == 0 and p[0]["prompt_tokens"] == 6000 for p in progress), progress
        done = [p[0]["computed_tokens"] for p in progress]
        assert done == sorted(done) and len(set(done)) == len(done), done  # sent only when it moved
        assert any(0 < d < 6000 for d in done), done
        eng.clear_prefix_cache()
        assert run({"include_usage": False})[0] == []
    finally:
        s.stop()
