"""Real third-party clients against a live `mbd-rs serve` on 127.0.0.1: LiteLLM and langchain-openai,
no mocks. The server is a subprocess of this interpreter (`sys.executable -m mbd_rs serve`) on the embedded model;
every answer is compared with the engine's own answer to the same request, computed in-process at temperature 0,
streams must reassemble to that text, and usage must match wherever the client exposes it. Every request is
bounded by a client timeout (and no retries), and no test may open a connection anywhere but the loopback.

Each client's tests skip, saying so, when it is not installed. They need a venv of their own: LiteLLM 1.106 requires
openai < 3 and huggingface_hub < 2, which the main test environment pins higher. Last run with litellm==1.106.0,
langchain-openai==1.7.3 (langchain-core==1.7.2), openai==2.54.0."""
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys

import pytest

# LiteLLM fetches its model cost map from GitHub at import unless told to use its bundled copy; LangChain traces to
# LangSmith only when asked, but say so anyway. Set before either is imported.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")

import mbd_rs  # noqa: E402
from conftest import serve_subprocess  # noqa: E402

httpx = pytest.importorskip("httpx", reason="httpx not installed")
pytest.importorskip("uvicorn", reason="server extra not installed (pip install 'mbd-rs[server]')")

KEY = "sk-clients-test"
MSG = [{"role": "user", "content": "sort 7 2 9 4 1"}]
MSG2 = [{"role": "user", "content": "reverse a b c d"}]
TIMEOUT = 60  # seconds, for every client request
GREEDY = dict(max_tokens=24, temperature=0)
KNOBS = {"block_size": 4, "threshold": 0.5}  # diffusion extensions, sent as extra body fields
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(model=None):
    """`mbd-rs serve` in a subprocess (on `model`, or the embedded one); yields (base URL, served model name)."""
    env = dict(os.environ, RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "2"))
    args = ["--api-key", KEY] + (["--model", model] if model else [])
    for base, name, _ in serve_subprocess(args, env=env):
        yield base + "/v1", name


@pytest.fixture(scope="module")
def server():
    yield from _serve()


@pytest.fixture(scope="module")
def tool_server(tool_model):
    """The server on the tool_model fixture (conftest): the embedded model with a chat template that renders tools."""
    yield from _serve(tool_model)


@pytest.fixture(scope="module")
def tool_engine(tool_model):
    return mbd_rs.Engine.load(tool_model)


# a tool the clients define (as a pydantic model, as LangChain's and LiteLLM's users do) and its JSON Schema
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_MSG = [{"role": "user", "content": "weather in Paris"}]
# the tools twin through LangChain: held-out requests whose call is right, round trips whose reply states the
# tool's answer and the city (bars below training/eval_tools.py's measurements, the twin's card, with margin)
TWIN_CALLS_RIGHT = 0.6
TWIN_STATED = 0.5


@pytest.fixture(scope="module")
def engine():
    return mbd_rs.Engine.load()


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Record every outgoing connection and name lookup of this process during these tests; only the loopback
    may be reached (LiteLLM must not phone home for cost maps, telemetry or anything else)."""
    elsewhere = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            elsewhere.append(("connect", address))
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kw):
        if host not in ("127.0.0.1", "::1", "localhost", None):
            elsewhere.append(("getaddrinfo", host))
        return real_getaddrinfo(host, *args, **kw)

    socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
    try:
        yield
    finally:
        socket.socket.connect, socket.getaddrinfo = real_connect, real_getaddrinfo
    assert not elsewhere, f"a client reached beyond 127.0.0.1: {elsewhere}"


def _template(engine, messages):
    """The chat prompt as text, so /v1/completions tests get the model's real answers rather than noise."""
    return engine.apply_chat_template(messages)


def _check_usage(prompt_tokens, completion_tokens, total_tokens, want):
    assert (prompt_tokens, completion_tokens, total_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.prompt_tokens + want.usage.completion_tokens)


# ---------------------------------------------------------------------------------------------------- LiteLLM


@pytest.fixture(scope="module")
def litellm():
    mod = pytest.importorskip("litellm", reason="litellm not installed (pip install litellm)")
    mod.telemetry = False
    mod.suppress_debug_info = True
    mod.callbacks, mod.success_callback, mod.failure_callback = [], [], []
    return mod


@pytest.fixture(scope="module")
def ll_args(server):
    base, name = server
    return dict(model=f"openai/{name}", api_base=base, api_key=KEY, timeout=TIMEOUT, num_retries=0)


@pytest.mark.parametrize("messages", [MSG, MSG2], ids=["sort", "reverse"])
def test_litellm_completion_matches_engine(litellm, ll_args, engine, messages):
    want = engine.chat(messages, **GREEDY)
    r = litellm.completion(messages=messages, **GREEDY, **ll_args)
    assert want.text and r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == want.finish_reason
    _check_usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens, want)


def test_litellm_completion_stream_reassembles(litellm, ll_args, engine):
    want = engine.chat(MSG, **GREEDY)
    chunks = list(litellm.completion(messages=MSG, stream=True, stream_options={"include_usage": True},
                                     **GREEDY, **ll_args))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 1 and "".join(deltas) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        want.finish_reason]
    usages = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert len(usages) == 1
    _check_usage(usages[0].prompt_tokens, usages[0].completion_tokens, usages[0].total_tokens, want)


def test_litellm_passes_diffusion_knobs(litellm, ll_args, engine):
    want = engine.chat(MSG2, **GREEDY, **KNOBS)
    r = litellm.completion(messages=MSG2, extra_body=KNOBS, **GREEDY, **ll_args)
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == want.usage.completion_tokens


def test_litellm_text_completion_matches_engine(litellm, ll_args, engine):
    prompt = _template(engine, MSG)
    want = engine.generate(prompt, **GREEDY)
    r = litellm.text_completion(prompt=prompt, **GREEDY, **ll_args)
    assert want.text and r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    _check_usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens, want)


def test_litellm_text_completion_stream_reassembles(litellm, ll_args, engine):
    prompt = _template(engine, MSG2)
    want = engine.generate(prompt, **GREEDY)
    chunks = list(litellm.text_completion(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                          **GREEDY, **ll_args))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        want.finish_reason]
    usages = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert len(usages) == 1
    _check_usage(usages[0].prompt_tokens, usages[0].completion_tokens, usages[0].total_tokens, want)


def test_litellm_async_stream(litellm, ll_args, engine):
    """acompletion goes through LiteLLM's async transport (not the sync one the tests above use)."""
    want = engine.chat(MSG2, **GREEDY)

    async def run():
        stream = await litellm.acompletion(messages=MSG2, stream=True, **GREEDY, **ll_args)
        return [c.choices[0].delta.content or "" async for c in stream if c.choices]

    assert "".join(asyncio.run(asyncio.wait_for(run(), TIMEOUT))) == want.text


def test_litellm_penalties_and_logit_bias(litellm, ll_args, engine):
    """presence_penalty and logit_bias reach the server through LiteLLM, and the answer is the engine's under the
    same controls (the bias bans the answer's first token: the answer changes)."""
    plain = engine.chat(MSG, **GREEDY)
    bias = {str(plain.token_ids[0]): -100}
    want = engine.chat(MSG, presence_penalty=0.5, logit_bias=bias, **GREEDY)
    assert want.token_ids[0] != plain.token_ids[0]
    r = litellm.completion(messages=MSG, presence_penalty=0.5, logit_bias=bias, **GREEDY, **ll_args)
    assert r.choices[0].message.content == want.text


def test_litellm_logprobs(litellm, ll_args, engine):
    """Chat logprobs through LiteLLM: each token's log-probability and alternatives, as the engine reports them."""
    want = engine.chat(MSG, logprobs=2, **GREEDY)
    r = litellm.completion(messages=MSG, logprobs=True, top_logprobs=2, **GREEDY, **ll_args)
    content = r.choices[0].logprobs["content"] if isinstance(r.choices[0].logprobs, dict) \
        else r.choices[0].logprobs.content
    got = [c["logprob"] if isinstance(c, dict) else c.logprob for c in content]
    assert got == pytest.approx([x.logprob for x in want.logprobs[:len(want.token_ids)]], abs=1e-5)  # no EOS
    assert len(got) == len(want.token_ids)


def _answer_model():
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        digits: list[int] = pydantic.Field(min_length=1, max_length=4)
        done: bool

    return Answer


def test_litellm_response_format_is_a_pydantic_model(litellm, ll_args, engine):
    """LiteLLM sends a pydantic model as OpenAI's json_schema response_format: the answer is the engine's own under
    the same model, and validates into it."""
    answer = _answer_model()
    want = engine.chat(MSG, response_format=answer, **dict(GREEDY, max_tokens=64))
    r = litellm.completion(messages=MSG, response_format=answer, **ll_args, **dict(GREEDY, max_tokens=64))
    assert r.choices[0].message.content == want.text and want.finish_reason == "stop"
    answer.model_validate_json(want.text)


def test_litellm_tools(litellm, tool_server, tool_engine):
    """LiteLLM's `tools` / `tool_choice`: the call the engine makes for the same request."""
    base, name = tool_server
    want = tool_engine.chat(WEATHER_MSG, tools=[WEATHER], tool_choice="required", max_tokens=96)
    r = litellm.completion(model="openai/" + name, api_base=base, api_key=KEY, messages=WEATHER_MSG, tools=[WEATHER],
                           tool_choice="required", max_tokens=96, temperature=0, timeout=TIMEOUT)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
        [(t.name, t.arguments) for t in want.tool_calls]


# ---------------------------------------------------------------------------------------------- langchain-openai


@pytest.fixture(scope="module")
def lc():
    return pytest.importorskip("langchain_openai", reason="langchain-openai not installed (pip install langchain-openai)")


@pytest.fixture(scope="module")
def lc_args(server):
    base, name = server
    return dict(model=name, base_url=base, api_key=KEY, temperature=0, max_tokens=GREEDY["max_tokens"],
                timeout=TIMEOUT, max_retries=0)


@pytest.mark.parametrize("messages", [MSG, MSG2], ids=["sort", "reverse"])
def test_langchain_chat_invoke_matches_engine(lc, lc_args, engine, messages):
    want = engine.chat(messages, **GREEDY)
    m = lc.ChatOpenAI(**lc_args).invoke(messages)
    assert want.text and m.content == want.text
    assert m.response_metadata["finish_reason"] == want.finish_reason
    u = m.usage_metadata
    _check_usage(u["input_tokens"], u["output_tokens"], u["total_tokens"], want)


def test_langchain_chat_stream_reassembles(lc, lc_args, engine):
    want = engine.chat(MSG, **GREEDY)
    chunks = list(lc.ChatOpenAI(stream_usage=True, **lc_args).stream(MSG))
    assert sum(1 for c in chunks if c.content) >= 1 and "".join(c.content for c in chunks) == want.text
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.content == want.text and whole.response_metadata["finish_reason"] == want.finish_reason
    u = whole.usage_metadata
    _check_usage(u["input_tokens"], u["output_tokens"], u["total_tokens"], want)


def test_langchain_chat_passes_diffusion_knobs(lc, lc_args, engine):
    want = engine.chat(MSG2, **GREEDY, **KNOBS)
    m = lc.ChatOpenAI(extra_body=KNOBS, **lc_args).invoke(MSG2)
    assert m.content == want.text and m.usage_metadata["output_tokens"] == want.usage.completion_tokens


def test_langchain_chat_async(lc, lc_args, engine):
    want = engine.chat(MSG, **GREEDY)
    chat = lc.ChatOpenAI(**lc_args)

    async def run():
        m = await chat.ainvoke(MSG)
        return m.content, "".join([c.content async for c in chat.astream(MSG)])

    assert asyncio.run(asyncio.wait_for(run(), TIMEOUT)) == (want.text, want.text)


def test_langchain_completions_llm_matches_engine(lc, lc_args, engine):
    prompt = _template(engine, MSG)
    want = engine.generate(prompt, **GREEDY)
    llm = lc.OpenAI(**lc_args)
    assert want.text and llm.invoke(prompt) == want.text
    r = llm.generate([prompt])
    g = r.generations[0][0]
    assert g.text == want.text and g.generation_info["finish_reason"] == want.finish_reason
    u = r.llm_output["token_usage"]
    _check_usage(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], want)
    assert "".join(llm.stream(prompt)) == want.text


def test_langchain_unsupported_feature_is_a_clear_400(lc, lc_args):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="service_tier is not supported by this server"):
        lc.ChatOpenAI(service_tier="flex", **lc_args).invoke(MSG)


def test_langchain_penalties(lc, lc_args, engine):
    want = engine.chat(MSG, frequency_penalty=1.0, **GREEDY)
    assert lc.ChatOpenAI(frequency_penalty=1.0, **lc_args).invoke(MSG).text == want.text


def test_langchain_logprobs(lc, lc_args, engine):
    """ChatOpenAI(logprobs=True) puts the server's chat logprobs in the message's response_metadata."""
    want = engine.chat(MSG, logprobs=3, **GREEDY)
    msg = lc.ChatOpenAI(logprobs=True, top_logprobs=3, **lc_args).invoke(MSG)
    content = msg.response_metadata["logprobs"]["content"]
    want_lp = [x.logprob for x in want.logprobs[:len(want.token_ids)]]  # content entries: no trailing EOS
    assert [c["logprob"] for c in content] == pytest.approx(want_lp, abs=1e-5)
    assert all(len(c["top_logprobs"]) == 3 for c in content)


def test_langchain_with_structured_output(lc, lc_args, engine):
    """ChatOpenAI.with_structured_output(Model) (OpenAI's json_schema response_format) returns the model's instance,
    the engine's own answer under the same model."""
    answer = _answer_model()
    want = answer.model_validate_json(engine.chat(MSG, response_format=answer, **dict(GREEDY, max_tokens=64)).text)
    chat = lc.ChatOpenAI(**dict(lc_args, max_tokens=64))
    assert chat.with_structured_output(answer, method="json_schema").invoke(MSG) == want


def test_langchain_bind_tools_and_a_tool_result_round_trip(lc, tool_server, tool_engine):
    """bind_tools(..., tool_choice="get_weather"): the AIMessage's tool_calls are the engine's; the tool's answer
    sent back as a ToolMessage renders and generates (the model was never taught tools: only the round trip is
    checked)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    base, name = tool_server
    chat = lc.ChatOpenAI(model=name, base_url=base, api_key=KEY, temperature=0, max_tokens=96, timeout=TIMEOUT,
                         max_retries=0)
    want = tool_engine.chat(WEATHER_MSG, tools=[WEATHER], tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}},
                            max_tokens=96)
    m = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke([HumanMessage("weather in Paris")])
    assert [(t["name"], t["args"]) for t in m.tool_calls] == [(t.name, json.loads(t.arguments))
                                                              for t in want.tool_calls]
    answer = chat.bind_tools([WEATHER]).invoke([HumanMessage("weather in Paris"), m,
                                                ToolMessage("sunny, 21 C", tool_call_id=m.tool_calls[0]["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.fixture(scope="module")
def twin_server():
    """The server on the tools twin (models/mbd-tools-tiny: taught to call get_weather / get_time)."""
    yield from _serve(os.path.join(ROOT, "models", "mbd-tools-tiny"))


def test_langchain_tool_round_trip_on_the_tools_twin(lc, twin_server):
    """bind_tools on the tools twin: held-out requests answered by the call of the right function with the city
    (the AIMessage's tool_calls), the tool's answer sent back as a ToolMessage, and the reply stating it in
    words. Bars below the twin's measured rates (its card), with margin."""
    from langchain_core.messages import HumanMessage, ToolMessage
    sys.path.insert(0, os.path.join(ROOT, "training"))
    from tool_tasks import held_out_calls, said, tool_result
    base, name = twin_server
    chat = lc.ChatOpenAI(model=name, base_url=base, api_key=KEY, temperature=0, max_tokens=96, timeout=TIMEOUT,
                         max_retries=0)
    r = random.Random(7)
    cases = held_out_calls(10, seed=23)
    right = stated = 0
    for msgs, tools, fn, city in cases:
        bound = chat.bind_tools(tools)
        ask = HumanMessage(msgs[0]["content"])
        m = bound.invoke([ask])
        right += [(t["name"], t["args"]) for t in m.tool_calls] == [(fn, {"city": city})]
        if len(m.tool_calls) != 1:
            continue
        content, words = tool_result(r, m.tool_calls[0]["name"])
        answer = bound.invoke([ask, m, ToolMessage(content, tool_call_id=m.tool_calls[0]["id"])])
        assert not answer.tool_calls
        stated += said(words.format(c=city), content, answer.content)
    assert right >= TWIN_CALLS_RIGHT * len(cases), right
    assert stated >= TWIN_STATED * len(cases), stated


def test_langchain_structured_output_by_function_calling(lc, tool_server):
    """with_structured_output(Model, method="function_calling", strict=True): a tool named after the model (in
    OpenAI's strict mode: no properties beyond the model's), its call parsed into the model."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(pattern="^[A-Za-z]{1,10}$")

    base, served = tool_server
    chat = lc.ChatOpenAI(model=served, base_url=base, api_key=KEY, temperature=0, max_tokens=96, timeout=TIMEOUT,
                         max_retries=0)
    out = chat.with_structured_output(City, method="function_calling", strict=True).invoke("weather in Paris")
    assert isinstance(out, City) and 1 <= len(out.name) <= 10


# ------------------------------------------------------------------------------------------------- README


def _readme_block(marker):
    """A client-library snippet of the server's manual page (docs/server.md)."""
    doc = open(os.path.join(ROOT, "docs", "server.md"), encoding="utf-8").read()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", doc, re.S) if marker in c]
    return code


@pytest.mark.parametrize("marker", ["import litellm", "from langchain_openai"])
def test_readme_client_examples(request, marker):
    """docs/server.md's LiteLLM and LangChain snippets run against the live server and print what they say."""
    pytest.importorskip(marker.split()[-1], reason=f"{marker.split()[-1]} not installed")
    base, _ = request.getfixturevalue("server")  # started only once the client is known to be there
    code = _readme_block(marker).replace("http://127.0.0.1:8000/v1", base).replace('"sk-local"', repr(KEY))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    want = [m.strip() for m in re.findall(r"# -> ([^(\n]*)", code)]
    assert want and r.stdout.splitlines() == want, (r.stdout, want)


def test_langchain_content_blocks(lc, lc_args, engine):
    """A message of LangChain content blocks (text parts) is the text parts joined with newlines."""
    from langchain_core.messages import HumanMessage
    blocks = [{"type": "text", "text": "sort 7 2 9"}, {"type": "text", "text": "4 1"}]
    want = engine.chat([{"role": "user", "content": "sort 7 2 9\n4 1"}], **GREEDY)
    assert lc.ChatOpenAI(**lc_args).invoke([HumanMessage(content=blocks)]).text == want.text
