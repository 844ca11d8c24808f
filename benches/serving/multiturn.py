"""A multi-turn chat through the server with the openai client: the time to first token of each turn, with the
prefix cache on and off, side by side (two servers on the same model, each turn sent to both in turn); with
`--llama-server`, against llama.cpp's server (`cache_prompt`, its default) on the same GGUF file instead.

The conversation: a long system prompt, then per turn a user message and the assistant's answer as the server gave
it, so turn k's rendered prompt repeats turn k-1's prompt and answer (as far as the template re-renders the answer
as the tokens the model wrote) and adds a message. With the cache, turn k starts from what turn k-1 left and
prefills the rest. The model directory is copied (its files hard-linked) with a ChatML template added.

    python scripts/make_bench_model.py            # /tmp/mbd-bench/qwen2.5-0.5b-shape
    python benches/serving/multiturn.py [--model DIR] [--turns 8] [--system-words 120] [--answer 16]

    LLAMACPP_SERVER=1 benches/llamacpp/build.sh && benches/llamacpp/same_file.sh SRC /tmp/llamacpp/ours
    python benches/serving/multiturn.py --gguf /tmp/llamacpp/ours/model-q8_0.gguf \
        --llama-server /tmp/llamacpp/build/bin/llama-server

The GGUF carries ChatML (scripts/write_gguf.py), which llama-server renders with its Jinja engine; both servers use
every core and are given the same conversation's messages, each its own answers (the engines decode differently).

Writes benches/results/batching-serving/multiturn.json, or multiturn-llamacpp-{gguf name}.json (--out).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import openai
from serving import free_port, run_meta

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
ap.add_argument("--turns", type=int, default=8)
ap.add_argument("--system-words", type=int, default=120)
ap.add_argument("--user-words", type=int, default=12)
ap.add_argument("--answer", type=int, default=16)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--gguf", default=None, help="serve this GGUF file (ChatML in it) instead of --model")
ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server: compare against it on --gguf")
ap.add_argument("--ctx", type=int, default=8192, help="llama-server's context")
ap.add_argument("--out", default=None)
args = ap.parse_args()
if args.llama_server and not args.gguf:
    ap.error("--llama-server needs --gguf (both engines load the same file)")
_name = "multiturn.json" if not args.llama_server else \
    f"multiturn-llamacpp-{os.path.splitext(os.path.basename(args.gguf))[0]}.json"
args.out = args.out or os.path.join(os.path.dirname(__file__), "..", "results", "batching-serving", _name)
meta = run_meta()  # before the run, so that a development build is warned of at once


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
    return started(subprocess.Popen([sys.executable, "-m", "mbd_rs", "serve", "--model", path, "--port", str(port),
                                     "--mask-token-id", "3", *extra],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def llama_server(gguf):
    """llama.cpp's server on the file: one slot, every core, its prompt cache on (cache_prompt is its default)."""
    port = free_port()
    threads = str(os.cpu_count() or 1)
    return started(subprocess.Popen([args.llama_server, "-m", gguf, "--port", str(port), "-t", threads, "-tb", threads,
                                     "-c", str(args.ctx), "-np", "1", "--jinja"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def started(p, port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    for _ in range(600):
        if p.poll() is not None:
            raise RuntimeError(f"server exited with {p.returncode}")
        try:
            return p, client, client.models.list().data[0].id
        except (openai.APIConnectionError, openai.APIStatusError):  # llama-server answers 503 while loading
            time.sleep(0.5)
    raise RuntimeError("server did not start")


def turn(client, model, messages):
    """(seconds to the first streamed content, the answer's text, cached prompt tokens, prompt tokens)."""
    t0 = time.perf_counter()
    first, text, cached, prompt = None, "", 0, 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.answer,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text += ch.choices[0].delta.content
        if ch.usage is not None:
            d = ch.usage.prompt_tokens_details
            cached = (d.cached_tokens or 0) if d else 0
            prompt = ch.usage.prompt_tokens
    return first if first is not None else time.perf_counter() - t0, text, cached, prompt


WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "number", "sort", "reverse", "seven", "nine",
         "list", "green", "paper", "quick", "north", "table", "light", "water"]


def words(n):
    return " ".join(r.choice(WORDS) for _ in range(n))


if args.llama_server:
    servers = {"mbd-rs": serve(args.gguf, []), "llama.cpp": llama_server(args.gguf)}
else:
    path = args.gguf or chat_model()
    servers = {"cache": serve(path, []), "no cache": serve(path, ["--prefix-cache", "0"])}
r = random.Random(0)
result = {k: [[] for _ in range(args.turns)] for k in servers}
cached = {k: [[] for _ in range(args.turns)] for k in servers}
prompts = {k: [[] for _ in range(args.turns)] for k in servers}
try:
    for rnd in range(args.rounds):
        system = {"role": "system", "content": words(args.system_words)}
        convo = {k: [system] for k in servers}
        for t in range(args.turns):
            user = {"role": "user", "content": words(args.user_words)}
            for name, (_, client, model) in servers.items():
                convo[name].append(user)
                s, text, c, n = turn(client, model, convo[name])
                convo[name].append({"role": "assistant", "content": text})
                result[name][t].append(s)
                cached[name][t].append(c)
                prompts[name][t].append(n)
            print(f"round {rnd} turn {t + 1}: " + ", ".join(
                f"{k} {result[k][t][-1] * 1e3:.0f} ms (cached {cached[k][t][-1]} of {prompts[k][t][-1]})"
                for k in servers), flush=True)
finally:
    for p, _, _ in servers.values():
        p.terminate()

med = {k: [statistics.median(v) for v in result[k]] for k in servers}
summary = {k: {"last_over_turn2": med[k][-1] / med[k][1], "median_ttft_ms": [round(x * 1e3, 1) for x in med[k]]}
           for k in servers}
if args.llama_server:  # per turn, mbd-rs / llama.cpp, paired within each round
    summary["ratio_per_turn"] = [round(statistics.median(a / b for a, b in zip(result["mbd-rs"][t],
                                                                                result["llama.cpp"][t])), 3)
                                 for t in range(args.turns)]
print(json.dumps(summary))
out = {**meta, "model": args.gguf or args.model, "args": vars(args), "ttft_s": result,
       "cached_tokens": cached, "prompt_tokens": prompts, "summary": summary}
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", args.out)
