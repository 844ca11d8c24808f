"""A multi-turn chat through the server with the openai client: the time to first token of each turn, with the
prefix cache on and off, side by side (two servers on the same model, each turn sent to both in turn).

The conversation: a long system prompt, then per turn a user message and the assistant's answer as the server gave
it, so turn k's rendered prompt repeats turn k-1's prompt and answer (as far as the template re-renders the answer
as the tokens the model wrote) and adds a message. With the cache, turn k starts from what turn k-1 left and
prefills the rest. The model directory is copied (its files hard-linked) with a ChatML template added.

    python scripts/make_bench_model.py            # /tmp/mbd-bench/qwen2.5-0.5b-shape
    python benches/serving/multiturn.py [--model DIR] [--turns 8] [--system-words 120] [--answer 16]

Writes benches/results/batching-serving/multiturn.json (--out).
"""
import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
ap.add_argument("--turns", type=int, default=8)
ap.add_argument("--system-words", type=int, default=120)
ap.add_argument("--user-words", type=int, default=12)
ap.add_argument("--answer", type=int, default=16)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "batching-serving",
                                              "multiturn.json"))
args = ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model():
    """The model directory with a ChatML chat template (its files hard-linked)."""
    d = "/tmp/mbd-bench/multiturn-model"
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(args.model):
        if f != "tokenizer_config.json" and not os.path.exists(os.path.join(d, f)):
            os.link(os.path.join(args.model, f), os.path.join(d, f))  # a hard link: symlinks out are refused
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>"}, f)
    return d


def serve(path, extra):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "mbd_rs", "serve", "--model", path, "--port", str(port),
                          "--mask-token-id", "3", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    for _ in range(600):
        try:
            client.models.list()
            return p, client
        except openai.APIConnectionError:
            time.sleep(0.5)
    raise RuntimeError("server did not start")


def turn(client, messages):
    """(seconds to the first streamed content, the answer's text, cached prompt tokens)."""
    t0 = time.perf_counter()
    first, text, cached = None, "", 0
    stream = client.chat.completions.create(model="multiturn-model", messages=messages, max_tokens=args.answer, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text += ch.choices[0].delta.content
        if ch.usage is not None:
            d = ch.usage.prompt_tokens_details
            cached = d.cached_tokens if d else 0
    return first if first is not None else time.perf_counter() - t0, text, cached


WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "number", "sort", "reverse", "seven", "nine",
         "list", "green", "paper", "quick", "north", "table", "light", "water"]


def words(n):
    return " ".join(r.choice(WORDS) for _ in range(n))


path = chat_model()
servers = {"cache": serve(path, []), "no cache": serve(path, ["--prefix-cache", "0"])}
r = random.Random(0)
result = {k: [[] for _ in range(args.turns)] for k in servers}
cached = {k: [[] for _ in range(args.turns)] for k in servers}
try:
    for rnd in range(args.rounds):
        system = {"role": "system", "content": words(args.system_words)}
        convo = {k: [system] for k in servers}
        for t in range(args.turns):
            user = {"role": "user", "content": words(args.user_words)}
            for name, (_, client) in servers.items():
                convo[name].append(user)
                s, text, c = turn(client, convo[name])
                convo[name].append({"role": "assistant", "content": text})
                result[name][t].append(s)
                cached[name][t].append(c)
            print(f"round {rnd} turn {t + 1}: "
                  + ", ".join(f"{k} {result[k][t][-1] * 1e3:.0f} ms (cached {cached[k][t][-1]})" for k in servers),
                  flush=True)
finally:
    for p, _ in servers.values():
        p.terminate()

med = {k: [sorted(v)[len(v) // 2] for v in result[k]] for k in servers}
summary = {k: {"turn8_over_turn2": med[k][-1] / med[k][1]} for k in servers}
print(json.dumps(summary))
flags = open("/proc/cpuinfo").read()
out = {"date": time.strftime("%Y-%m-%d"),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "cpu": platform.processor() or platform.machine(), "avx512": "avx512f" in flags, "cores": os.cpu_count(),
       "model": args.model, "args": vars(args), "ttft_s": result, "cached_tokens": cached, "summary": summary}
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", args.out)
