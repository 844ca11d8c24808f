"""Structured outputs: every output a generation finishes under a grammar (`response_format` json_schema or
json_object, `grammar`, `regex`) is accepted by it, checked by independent validators (the `jsonschema` package for
JSON schemas, Python's `re` for regexes, llguidance's own Python package for prefixes cut by max_tokens); constrained
greedy AR equals a reference decoder written here (greedy over the engine's logits with llguidance's Python masks and
forced tokens, its vocabulary built by llguidance from tokenizer.json, not by the engine); a grammar that admits
every text changes nothing; batched constrained streams equal their lone runs; hostile grammars get specific errors
in bounded time. The speculative decoders keep to the grammar too: S2D2's drafts are the grammar's chain and its
verifier reads the same masks; constrained greedy ISD equals the reference decoder (so constrained greedy AR), and
sampled ISD writes tokens distributed as the masked verifier."""
import functools
import json
import os
import re
import time

import numpy as np
import pytest

import mbd_rs
from mbd_rs import InvalidRequestError
from conftest import parity_dir

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(os.path.dirname(HERE), "models")

# bounded schemas (every value has a largest length), so that an output finishes within max_tokens: nested objects,
# arrays with min/max items, enums, bounded integers and numbers, required and optional fields, string patterns,
# anyOf, const, booleans
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "minItems": 1,
                 "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "string", "maxLength": 4}]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "string", "maxLength": 6}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3, "x"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "move"}, "steps": {"type": "integer", "minimum": 1,
                                                                          "maximum": 4}},
     "required": ["kind", "steps"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
     "required": ["score"], "additionalProperties": False},
]
PROMPTS = ["sort 5 3 8 1", "reverse a b c", "hello Grace", "add 12+34", "count a in abca"]
# the block decoders and their acceptance rules, greedy and sampled
MODES = {
    "ar": dict(block_size=1),
    "single-block": dict(block_size=4, threshold=0.5, block_add_threshold=1.0, decoded_token_threshold=1.0),
    "multi-block": dict(),
    "confidence": dict(acceptance="confidence", threshold=0.9),
    "eb": dict(acceptance="eb", threshold=0.3),
    "bacd": dict(acceptance="bacd"),
    "credit": dict(acceptance="credit"),
    "dus": dict(acceptance="dus"),
    "sampled": dict(temperature=1.0),
    "sampled-top-p": dict(temperature=0.8, top_p=0.9, block_size=4),
    # S2D2: every span verified (the drafts are the grammar's chain), greedy and sampled; the default routing
    "s2d2": dict(speculative="s2d2", verify_policy="always"),
    "s2d2-sampled": dict(speculative="s2d2", verify_policy="always", temperature=1.0),
    "s2d2-score": dict(speculative="s2d2"),
    # ISD, on the I-DLM twin (causal, shifted logits): greedy, sampled, a long stride with top-k
    "isd": dict(speculative="isd"),
    "isd-sampled": dict(speculative="isd", temperature=1.0),
    "isd-stride7-top-k": dict(speculative="isd", isd_stride=7, temperature=0.7, top_k=5),
}
IDLM = os.path.join(MODELS, "mbd-idlm-tiny")
AS_IDLM = dict(attention="causal", logits_shift=True)


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def check_json(text, schema, finish):
    """A finished output parses and validates; every output is what the schema's grammar can still extend."""
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish == "length", finish


@pytest.fixture(scope="module")
def tiny():
    return mbd_rs.Engine.load()


@pytest.fixture(scope="module")
def idlm():
    if not os.path.isdir(IDLM):
        pytest.skip(f"{IDLM} is not in this tree")
    return mbd_rs.Engine.load(IDLM, **AS_IDLM)


@pytest.fixture
def engine_for(request):
    """The model a mode runs on: the I-DLM twin for ISD, the embedded model otherwise."""
    return lambda mode: request.getfixturevalue("idlm" if mode.startswith("isd") else "tiny")


def run_schemas(eng, mode, per_mode, seed0=0):
    """`per_mode` constrained chats over the schemas and prompts (started together, so they batch), checked."""
    streams = []
    i = 0
    while len(streams) < per_mode:
        schema, prompt = SCHEMAS[i % len(SCHEMAS)], PROMPTS[(i // len(SCHEMAS)) % len(PROMPTS)]
        kw = dict(MODES[mode])
        if "temperature" in kw:
            kw["seed"] = seed0 + i
        streams.append((schema, eng.stream_chat([{"role": "user", "content": prompt}], max_tokens=64,
                                                response_format=json_schema_format(schema), **kw)))
        i += 1
    finished = 0
    for schema, s in streams:
        c = s.result()
        check_json(c.text, schema, c.finish_reason)
        finished += c.finish_reason == "stop"
    return finished


@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_match_their_schemas_in_every_mode(engine_for, mode):
    finished = run_schemas(engine_for(mode), mode, 35)
    assert finished >= 30, f"{finished} of 35 finished"  # bounded schemas: cut outputs are rare


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_two_hundred_outputs_per_mode_match_their_schemas(engine_for, mode):
    assert run_schemas(engine_for(mode), mode, 200, seed0=1000) >= 180


TWINS = {
    "mbd-dream-tiny": dict(),  # full attention, no cache (its default)
    "mbd-fdv2-tiny": dict(),  # Fast-dLLM v2's sub-blocks
    "mbd-qwen35-tiny": dict(block_size=8, threshold=0.5),  # Gated DeltaNet layers beside attention
    "mbd-idlm-tiny": dict(),  # loaded as its config says (SDAR: block-causal); as I-DLM in the ISD modes above
}


@pytest.mark.parametrize("twin", list(TWINS))
def test_the_twins_outputs_match_their_schemas(twin):
    path = os.path.join(MODELS, twin)
    if not os.path.isdir(path):
        pytest.skip(f"{path} is not in this tree")
    eng = mbd_rs.Engine.load(path)
    streams = [(s, eng.stream_chat([{"role": "user", "content": p}], max_tokens=64,
                                   response_format=json_schema_format(s), **TWINS[twin]))
               for s in SCHEMAS for p in PROMPTS[:3]]
    for schema, s in streams:
        c = s.result()
        check_json(c.text, schema, c.finish_reason)


# ---- grammars and regexes --------------------------------------------------------------------------------------

ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""


def arithmetic_ok(text):
    """An independent check of ARITHMETIC: Python evaluates it (a syntax error raises)."""
    assert re.fullmatch(r"[0-9+\-*/()]+", text), text
    compile(text, "<grammar output>", "eval")


@pytest.mark.parametrize("mode", ["ar", "multi-block", "sampled"])
def test_a_lark_grammar_and_a_regex_hold(tiny, mode):
    kw = MODES[mode]
    for i, p in enumerate(PROMPTS):
        seed = dict(seed=i) if "temperature" in kw else {}
        c = tiny.chat([{"role": "user", "content": p}], max_tokens=32, grammar=ARITHMETIC, **kw, **seed)
        if c.finish_reason == "stop":
            arithmetic_ok(c.text)
        rx = r"(yes|no), [0-9]{1,2} (apples|pears)"
        c = tiny.chat([{"role": "user", "content": p}], max_tokens=32, regex=rx, **kw, **seed)
        assert c.finish_reason == "stop" and re.fullmatch(rx, c.text), (c.text, c.finish_reason)


def test_a_cut_output_is_a_prefix_the_grammar_can_extend(tiny):
    """max_tokens cuts a constrained output: finish_reason "length", and llguidance's Python matcher (its vocabulary
    built from the model's tokenizer.json) takes every token of it."""
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}},
              "required": ["words"]}
    c = tiny.chat([{"role": "user", "content": "reverse a b c d e f"}], max_tokens=12,
                  response_format=json_schema_format(schema))
    assert c.finish_reason == "length" and len(c.token_ids) == 12, c
    tok = ll_tokenizer(os.path.join(tiny.info.path, "tokenizer.json"), tiny.info.vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=LAYOUT)
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert m.validate_tokens(list(c.token_ids)) == len(c.token_ids) and not m.is_error()


# ---- exactness ---------------------------------------------------------------------------------------------------


def ll_tokenizer(tokenizer_json, vocab):
    """llguidance's view of a vocabulary, built outside the engine: from tokenizer.json by llguidance itself, or
    (for decoders its converter does not read, as mbd-tiny's) from each token's text as the `tokenizers` package
    decodes it, control tokens marked special."""
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab)
    except ValueError:
        pass
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(tokenizer_json)
    special = sorted(i for i, a in t.get_added_tokens_decoder().items() if a.special)

    class Words:
        eos_token_id = special[0] if special else 0
        bos_token_id = None
        tokens = [t.decode([i], skip_special_tokens=False).encode() for i in range(vocab)]
        special_token_ids = special

        def __call__(self, s):
            return t.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s,
                            add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Words()), n_vocab=vocab)


# the JSON layout the engine gives a schema that sets none (one line, json.dumps's separators)
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def reference_greedy(eng, tokenizer_json, prompt, grammar, max_tokens, eos_ids):
    """Greedy AR under a grammar, written from llguidance's sampling loop: the forced tokens taken as they come,
    else the argmax of the model's next-token logits (the engine's logits, which equal transformers') with every
    token the grammar's mask refuses removed; an end-of-text id is allowed where the grammar accepts."""
    tok = ll_tokenizer(tokenizer_json, eng.info.vocab_size)
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    out = []
    while len(out) < max_tokens:
        forced = m.compute_ff_tokens()
        if forced:
            take = forced[:max_tokens - len(out)]
            assert m.consume_tokens(take)
            out += take
            continue
        row = eng.logits(prompt + out, attention="causal")[-1].astype(np.float64)
        allowed = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:len(row)] > 0
        allowed[list(eos_ids)] = m.is_accepting()
        row[~allowed] = -np.inf
        t = int(np.argmax(row))
        out.append(t)
        if t in eos_ids:
            break
        assert m.consume_token(t), m.get_error()
    return out


FAMILIES = ["qwen2_gqa_tied", "qwen3_bias_tied", "qwen3moe_top2_norm", "qwen35_hybrid"]
GRAMMARS = {
    "schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS[1], defaults=LAYOUT),
    "regex": lambda: llguidance.LLMatcher.grammar_from_regex(r"[a-f]{2,6}( [0-9]{1,3}){1,3}"),
    "lark": lambda: llguidance.LLMatcher.grammar_from_lark(ARITHMETIC),
}
ENGINE_ARGS = {"schema": lambda: dict(response_format=json_schema_format(SCHEMAS[1])),
               "regex": lambda: dict(regex=r"[a-f]{2,6}( [0-9]{1,3}){1,3}"), "lark": lambda: dict(grammar=ARITHMETIC)}


@functools.lru_cache(maxsize=None)
def causal_engine(family):
    return mbd_rs.Engine.load(parity_dir(family), device="cpu", mask_token_id=3, attention="causal", logits_shift=True,
                              eos_token_ids=[0])


@functools.lru_cache(maxsize=None)
def reference_for(family, kind):
    path = parity_dir(family)
    prompt = [(37 * i + 11) % 300 + 5 for i in range(9)]
    want = reference_greedy(causal_engine(family), os.path.join(path, "tokenizer.json"), prompt, GRAMMARS[kind](), 40,
                            [0])
    return prompt, [t for t in want if t != 0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_greedy_ar_equals_the_masked_reference(family, kind):
    prompt, want = reference_for(family, kind)
    got = causal_engine(family).generate(prompt, max_tokens=40, block_size=1, **ENGINE_ARGS[kind]())
    assert list(got.token_ids) == want, (got.token_ids, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
def test_constrained_greedy_isd_equals_the_masked_reference(family, kind, stride, use_cache):
    """ISD's verifier reads each row under the grammar's mask after the tokens before it, and the grammar's forced
    tokens ride ahead of the drafts: so it writes what constrained greedy AR writes, in fewer forwards when drafts
    are accepted."""
    prompt, want = reference_for(family, kind)
    got = causal_engine(family).generate(prompt, max_tokens=40, speculative="isd", isd_stride=stride,
                                         use_cache=use_cache, **ENGINE_ARGS[kind]())
    assert list(got.token_ids) == want, (got.token_ids, want)
    u = got.usage
    assert u.forward_passes + u.drafts_accepted + u.forced_tokens >= len(want)
    assert u.drafts_accepted <= u.drafts_proposed <= (stride - 1) * u.verifications


def test_sampled_constrained_isd_writes_tokens_distributed_as_the_masked_verifier():
    """max_tokens=2 under a regex: the first step writes t0 from the verifier's distribution under the grammar's first
    mask and drafts t1 from the mask row under the mask after t0; the second verifies that draft. By the speculative
    sampling theorem t1 | t0 is distributed as the verifier under the mask after t0, computed here from the logits
    API and llguidance's Python masks."""
    family, regex, top_k, runs = "qwen2_gqa_tied", r"[a-f]{1,2}[0-9]{1,2}", 4, 3000
    eng = causal_engine(family)
    tok = ll_tokenizer(os.path.join(parity_dir(family), "tokenizer.json"), eng.info.vocab_size)
    prompt = [99, 4, 250]

    def masked_dist(ids, after):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
        assert m.consume_tokens(after)
        row = eng.logits(ids, attention="causal")[-1].astype(np.float64)
        allowed = np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:len(row)] > 0
        allowed[0] = m.is_accepting()
        row[~allowed] = -np.inf
        idx = np.argsort(-row, kind="stable")[:top_k]
        idx = idx[np.isfinite(row[idx])]
        p = np.exp(row[idx] - row[idx].max())
        return dict(zip(idx.tolist(), (p / p.sum()).tolist()))

    t0s, pairs, proposed, accepted = {}, {}, 0, 0
    for seed in range(runs):
        c = eng.generate(prompt, max_tokens=2, early_stop=False, temperature=1.0, top_k=top_k, seed=seed,
                         speculative="isd", isd_stride=4, regex=regex)
        t0, t1 = (list(c.token_ids) + [0, 0])[:2]
        assert c.usage.forced_tokens == 0
        t0s[t0] = t0s.get(t0, 0) + 1
        pairs.setdefault(t0, []).append(t1)
        proposed, accepted = proposed + c.usage.drafts_proposed, accepted + c.usage.drafts_accepted
    assert 0.1 * proposed < accepted < 0.9 * proposed  # both accepted drafts and corrections

    def check(counts, p, n):
        for t, pt in p.items():
            f = counts.get(t, 0) / n
            assert abs(f - pt) < 4.5 * np.sqrt(pt * (1 - pt) / n) + 1e-3, (t, f, pt)
        assert set(counts) <= set(p), (counts, p)

    check(t0s, masked_dist(prompt, []), runs)
    t0 = max(pairs, key=lambda t: len(pairs[t]))
    ones = pairs[t0]
    check({t: ones.count(t) for t in set(ones)}, masked_dist(prompt + [t0], [t0]), len(ones))


ADMIT_ALL = r"[\s\S]*"


@pytest.mark.parametrize("mode", ["ar", "multi-block", "confidence", "sampled", "s2d2", "s2d2-sampled", "isd",
                                  "isd-sampled"])
def test_a_grammar_that_admits_every_text_changes_nothing(engine_for, mode):
    eng, kw = engine_for(mode), dict(MODES[mode])
    for i, p in enumerate(PROMPTS):
        if "temperature" in kw:
            kw["seed"] = i
        free = eng.chat([{"role": "user", "content": p}], max_tokens=32, **kw)
        constrained = eng.chat([{"role": "user", "content": p}], max_tokens=32, regex=ADMIT_ALL, **kw)
        assert constrained.token_ids == free.token_ids and constrained.usage.forward_passes == free.usage.forward_passes


@pytest.mark.parametrize("engine,modes", [("tiny", ["multi-block", "ar", "sampled", "eb", "s2d2", "s2d2-sampled"]),
                                          ("idlm", ["isd", "isd-sampled", "isd-stride7-top-k"])])
def test_batched_constrained_streams_equal_their_lone_runs(request, engine, modes):
    tiny = request.getfixturevalue(engine)
    reqs = [(p, s, m) for p, s, m in zip(PROMPTS * 2, SCHEMAS * 2, modes * 4)]
    kwargs = [dict(MODES[m], seed=7) if "temperature" in MODES[m] else dict(MODES[m]) for _, _, m in reqs]
    alone = [tiny.chat([{"role": "user", "content": p}], max_tokens=48, response_format=json_schema_format(s), **kw)
             for (p, s, _), kw in zip(reqs, kwargs)]
    streams = [tiny.stream_chat([{"role": "user", "content": p}], max_tokens=48,
                                response_format=json_schema_format(s), **kw)
               for (p, s, _), kw in zip(reqs, kwargs)]
    together = [s.result() for s in streams]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.usage.forward_passes == b.usage.forward_passes


def test_forced_tokens_are_written_without_a_forward(tiny):
    """A schema with long fixed parts: the keys and punctuation are written as the grammar forces them, so the output
    takes fewer forwards than it has tokens, even decoding one position per step."""
    schema = {"type": "object", "properties": {"first_answer": {"enum": ["yes", "no"]},
                                               "second_answer": {"enum": ["yes", "no"]}},
              "required": ["first_answer", "second_answer"], "additionalProperties": False}
    c = tiny.chat([{"role": "user", "content": "hello Grace"}], max_tokens=80, block_size=1,
                  response_format=json_schema_format(schema))
    check_json(c.text, schema, c.finish_reason)
    assert c.finish_reason == "stop"
    assert c.usage.forward_passes < len(c.token_ids) / 2, c.usage


def test_pydantic_models_are_response_formats(tiny):
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        ok: bool
        digit: int = pydantic.Field(ge=0, le=9)
        word: str = pydantic.Field(max_length=4)

    c = tiny.chat([{"role": "user", "content": "add 1+2"}], max_tokens=80, response_format=Answer)
    assert c.finish_reason == "stop"
    a = Answer.model_validate_json(c.text)
    assert 0 <= a.digit <= 9


# ---- hostile ------------------------------------------------------------------------------------------------------

HOSTILE = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     r"response_format: .*objekt"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), r"needs|must have a 'schema'"),
    (dict(response_format={"type": "yaml"}), r"type must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    (dict(response_format="[1, 2"), r"response_format: not JSON"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?=x)"}}}),
     r"response_format:"),
    (dict(grammar="start: (("), r"grammar:"),
    (dict(grammar="start: a\na: a"), r"grammar:"),
    (dict(regex="(unclosed"), r"regex:"),
    (dict(regex=r"(a)\1"), r"regex:"),
    (dict(regex="[0-9]+", grammar="start: \"x\""), r"grammar and regex each constrain the output: give one"),
    (dict(regex="[0-9]+", tccf=True, tccf_trigger="a"), r"regex does not combine with tccf"),
    (dict(regex="[0-9]+", logprobs=1), r"regex does not combine with logprobs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/missing"}}}),
     r"response_format:"),
    (dict(grammar="x" * (64 * 1024 + 1)), r"grammar is text of more than 65536 characters"),
]


@pytest.mark.parametrize("kw,msg", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_hostile_grammars_get_specific_errors_quickly(tiny, kw, msg):
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=msg):
        tiny.chat([{"role": "user", "content": "sort 3 1 2"}], max_tokens=8, **kw)
    assert time.perf_counter() - t0 < 10


def test_a_schema_that_recurses_without_end_is_bounded(tiny):
    """A schema whose only values are infinite (an object that must hold itself): refused at compile time, or, where
    llguidance builds it, every output is cut at max_tokens as a valid prefix; either way in bounded time."""
    schema = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"],
                              "additionalProperties": False}}, "$ref": "#/$defs/n"}
    t0 = time.perf_counter()
    try:
        c = tiny.chat([{"role": "user", "content": "x"}], max_tokens=24, response_format=json_schema_format(schema))
        assert c.finish_reason == "length"
    except InvalidRequestError as e:
        assert "response_format" in str(e)
    assert time.perf_counter() - t0 < 10


def test_a_huge_schema_is_refused_by_its_bound(tiny):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20000)}}
    with pytest.raises(InvalidRequestError, match=r"response_format is text of more than 262144 characters"):
        tiny.chat([{"role": "user", "content": "x"}], max_tokens=4, response_format=json_schema_format(schema))


# ---- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny):
    pytest.importorskip("uvicorn")
    from conftest import Server
    s = Server(tiny)
    yield s
    s.stop()


def test_the_openai_client_parses_into_a_pydantic_model(served, tiny):
    """The official client's `parse` sends a strict json_schema built from a pydantic model; the server's output
    validates into the model, equals the engine's own run, and its usage counts the forced tokens."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Move(pydantic.BaseModel):
        direction: str = pydantic.Field(pattern="^(up|down|left|right)$")
        steps: int = pydantic.Field(ge=1, le=5)

    client = openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "reverse a b c"}]
    r = client.chat.completions.parse(model="mbd-tiny", messages=msgs, max_tokens=64, temperature=0,
                                      response_format=Move)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Move) and 1 <= m.parsed.steps <= 5
    want = tiny.chat(msgs, max_tokens=64, response_format=Move)
    assert m.content == want.text
    assert r.usage.model_extra["forced_tokens"] == want.usage.forced_tokens > 0


def test_the_server_streams_json_mode_and_refuses_bad_formats(served):
    httpx = pytest.importorskip("httpx")
    body = {"messages": [{"role": "user", "content": "sort 5 3 8"}], "max_tokens": 48, "stream": True,
            "response_format": {"type": "json_object"}}
    with httpx.stream("POST", served.base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == ["length"]
    bad = dict(body, stream=False, response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}})
    r = httpx.post(served.base + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("response_format:"), r.text


def test_a_pydantic_schema_is_made_strict_in_its_schemas_only():
    """Every object schema gets additionalProperties false (OpenAI's strict mode); data under enum/const does not,
    and a property named like a keyword is a schema."""
    from mbd_rs.tools import strict_schema
    s = strict_schema({"type": "object", "properties": {"enum": {"type": "object"}, "c": {"const": {"type": "object"}}},
                 "$defs": {"d": {"type": "object", "additionalProperties": True}}})
    assert s["additionalProperties"] is False and s["properties"]["enum"]["additionalProperties"] is False
    assert s["properties"]["c"] == {"const": {"type": "object"}}
    assert s["$defs"]["d"]["additionalProperties"] is True
