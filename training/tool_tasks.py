"""Tool-call tasks for the tools twin (models/mbd-tools-tiny, `train.py --family tools`): conversations with OpenAI
`tools` rendered by TOOLS_TEMPLATE, a chat template with a compact tool list (one `name(parameters)` per tool, not
the whole JSON Schema, so that a character-level model's prompts stay short) and Hermes' call format
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, what the engine's tool grammar writes and its
parser reads).

Kinds of sample:
  call    the user asks for the weather or the time of a city, the tools are listed: the answer is the call of the
          right function with the city (held out iff the user's message is, by tasks.is_held_out)
  result  the same conversation, the assistant's call and the tool's JSON answer (a `role: "tool"` message): the
          answer says the result in words ("It is 18 degrees and sunny in Paris.")
  plain   an old task (tasks.py) with the tools listed: the old answer, no call (without tools listed: the old
          tasks as the embedded model learned them)
`render_chat` renders messages exactly as TOOLS_TEMPLATE does (the engine's minijinja and transformers' Jinja2);
tests/test_tool_twin.py checks that the engine's rendering is the same."""
import json
import random

from tasks import TASKS, is_held_out, made_up_name, sample

CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Oslo", "Dublin",
          "Athens", "Sofia", "Zagreb", "Riga", "Vilnius", "Tallinn", "Helsinki", "Moscow", "Kyiv", "Minsk", "Ankara",
          "Cairo", "Tunis", "Algiers", "Nairobi", "Lagos", "Accra", "Dakar", "Luanda", "Harare", "Kampala", "Tokyo",
          "Osaka", "Kyoto", "Seoul", "Busan", "Beijing", "Shanghai", "Shenzhen", "Taipei", "Manila", "Hanoi",
          "Bangkok", "Jakarta", "Delhi", "Mumbai", "Chennai", "Kolkata", "Dhaka", "Karachi", "Lahore", "Kabul",
          "Tehran", "Baghdad", "Riyadh", "Doha", "Dubai", "Muscat", "Amman", "Beirut", "Sydney", "Perth",
          "Brisbane", "Adelaide", "Auckland", "Toronto", "Montreal", "Ottawa", "Calgary", "Chicago", "Boston",
          "Seattle", "Denver", "Austin", "Dallas", "Houston", "Miami", "Atlanta", "Phoenix", "Portland", "Detroit",
          "Lima", "Quito", "Bogota", "Caracas", "Santiago", "Havana", "Mexico", "Brussels", "Geneva", "Zurich",
          "Munich", "Hamburg", "Milan", "Naples", "Venice", "Florence", "Lyon", "Marseille", "Nice", "Porto",
          "Seville", "Valencia", "Bilbao", "Krakow", "Gdansk", "Bergen", "Malmo", "Aarhus", "Reykjavik", "Edinburgh",
          "Glasgow", "Cardiff", "Belfast", "Cork", "Leeds", "Bristol", "Oxford", "Cambridge"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]

WEATHER_ASKS = ["weather in {c}", "what's the weather in {c}?", "{c} weather", "how is the weather in {c}?",
                "what is the weather like in {c}?", "tell me the weather in {c}", "weather {c}",
                "is it raining in {c}?", "temperature in {c}", "forecast for {c}", "how warm is it in {c}?",
                "weather in {c} please"]
TIME_ASKS = ["time in {c}", "what time is it in {c}?", "{c} time", "current time in {c}", "what's the time in {c}?",
             "tell me the time in {c}", "local time in {c}", "clock in {c}", "what is the time in {c} now?",
             "time {c}", "the time in {c} please"]


def tool(name, description, params):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in params},
                       "required": list(params), "additionalProperties": False}}}


WEATHER = tool("get_weather", "The current weather in a city", ["city"])
TIME = tool("get_time", "The local time in a city", ["city"])
TOOLS = {"get_weather": WEATHER, "get_time": TIME}

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "tools:{% for t in tools %} {{ t['function']['name'] }}("
    "{% for p in t['function']['parameters']['properties'] %}{{ p }}{% if not loop.last %},{% endif %}{% endfor %}"
    "){% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and tools and loop.first %}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for c in m['tool_calls'] %}{% set f = c['function'] %}<tool_call>\n"
    "{\"name\": \"{{ f['name'] }}\", \"arguments\": {{ '{' }}"
    "{% for k, v in f['arguments'] | dictsort %}\"{{ k }}\": {{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}{{ '}}' }}\n</tool_call>{% if not loop.last %}\n{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>tool\n{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call_text(name, arguments):
    """A call as the engine's tool grammar lays it out (json.dumps separators, one line)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def render_chat(messages, tools=None, add_generation_prompt=True):
    """messages (OpenAI's, arguments as objects or JSON text) rendered as TOOLS_TEMPLATE renders them."""
    out = []
    if tools:
        sys_line = messages[0]["content"] + "\n" if messages and messages[0]["role"] == "system" else ""
        sig = " ".join(f"{t['function']['name']}({','.join(t['function']['parameters'].get('properties', {}))})"
                       for t in tools)
        out.append(f"<|im_start|>system\n{sys_line}tools: {sig}<|im_end|>\n")
    for i, m in enumerate(messages):
        if m["role"] == "system" and tools and i == 0:
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            head = m["content"] + "\n" if m.get("content") else ""
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                args = json.loads(args) if isinstance(args, str) else args
                calls.append(call_text(c["function"]["name"], dict(sorted(args.items()))))
            out.append(f"<|im_start|>assistant\n{head}" + "\n".join(calls) + "<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


MADE_UP = 0.4   # the fraction of made-up city names (training may ask for more: train.py --made-up)


def city(r, made_up=None):
    real = 1 - MADE_UP if made_up is None else 1 - made_up
    return r.choice(CITIES) if r.random() < real else made_up_name(r)


def tools_for(r, need=None):
    """The tools listed in a prompt: the one needed (if any) alone or with the other, in either order."""
    names = r.choice([["get_weather"], ["get_time"], ["get_weather", "get_time"], ["get_time", "get_weather"]])
    if need is not None and need not in names:
        names = r.choice([[need], [need, *[n for n in TOOLS if n != need]], [*[n for n in TOOLS if n != need], need]])
    return [TOOLS[n] for n in names]


def ask(r, held_out, made_up=None):
    """(function, city, user message) of the requested split (made_up: the fraction of made-up names)."""
    while True:
        fn = r.choice(list(TOOLS))
        c = city(r, made_up)
        msg = r.choice(WEATHER_ASKS if fn == "get_weather" else TIME_ASKS).format(c=c)
        if is_held_out(msg) == held_out:
            return fn, c, msg


def tool_result(r, fn):
    """(the tool's JSON answer, the words that say it for a city `{c}`)."""
    if fn == "get_weather":
        t, cond = r.randint(-15, 40), r.choice(CONDITIONS)
        return json.dumps({"temperature": t, "condition": cond}), f"It is {t} degrees and {cond} in {{c}}."
    h, m = r.randint(0, 23), r.randint(0, 59)
    return json.dumps({"time": f"{h:02d}:{m:02d}"}), f"It is {h:02d}:{m:02d} in {{c}}."


def call_message(fn, c):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": fn, "arguments": json.dumps({"city": c})}}]}


def call_case(r, held_out, made_up=None):
    """(messages, tools, function, city): a request for a call."""
    fn, c, msg = ask(r, held_out, made_up)
    return [{"role": "user", "content": msg}], tools_for(r, fn), fn, c


def result_case(r, held_out, made_up=None):
    """(messages, tools, the tool's JSON answer, the words wanted): a conversation ending in the tool's answer."""
    fn, c, msg = ask(r, held_out, made_up)
    content, words = tool_result(r, fn)
    msgs = [{"role": "user", "content": msg}, call_message(fn, c),
            {"role": "tool", "tool_call_id": "call_0", "content": content}]
    return msgs, tools_for(r, fn), content, words.format(c=c)


def draw(r, kind, held_out=False, task_weights=None, made_up=None, with_city=False):
    """One (prompt text, answer text) of a kind: call, result, plain (an old task with tools listed) or bare (an
    old task without tools, as tasks.render). made_up: the fraction of made-up city names (None: MADE_UP).
    with_city: (prompt, answer, the city's span in the answer as (start, end) characters, or None)."""
    if kind == "call":
        msgs, tools, fn, c = call_case(r, held_out, made_up)
        a = call_text(fn, {"city": c})
        return (render_chat(msgs, tools), a) + (((a.rfind(c), a.rfind(c) + len(c)),) if with_city else ())
    if kind == "result":
        msgs, tools, _, words = result_case(r, held_out, made_up)
        c = words.rsplit(" in ", 1)[1].rstrip(".")
        return (render_chat(msgs, tools), words) + (((words.rfind(c), words.rfind(c) + len(c)),) if with_city else ())
    keys = list(task_weights or TASKS)
    task = r.choices(keys, weights=[(task_weights or {}).get(k, 1.0) for k in keys])[0]
    _, p, a = sample(r, held_out, task)
    return (render_chat([{"role": "user", "content": p}], tools_for(r) if kind == "plain" else None), a) + (
        (None,) if with_city else ())


def held_out_calls(n, seed=11):
    """n held-out call requests (messages, tools, function, city), seeded (tests, evaluation)."""
    r = random.Random(seed)
    return [call_case(r, True) for _ in range(n)]


def held_out_results(n, seed=12):
    """n held-out tool-result conversations (messages, tools, tool answer, words), seeded."""
    r = random.Random(seed)
    return [result_case(r, True) for _ in range(n)]


def said(words_wanted, content, text):
    """Whether an answer says the tool's result: its numbers/time and condition, and the city, all appear."""
    obj = json.loads(content)
    city = words_wanted.rsplit(" in ", 1)[1].rstrip(".")
    return all(str(v) in text for v in obj.values()) and city in text
