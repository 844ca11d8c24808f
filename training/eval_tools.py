"""The tools twin's results with the engine itself (mbd_rs, not PyTorch): on held-out prompts (training/tool_tasks.py),
under several decodings,
  calls       the fraction of weather/time requests, given the tools and tool_choice="auto", whose reply is one call
              of the right function with the city as its argument (and of those whose one call names the right
              function, whatever its arguments)
  round trip  the fraction of conversations ending in the tool's answer whose reply is words (no call) that state
              the result (its values and the city; and of those that state the values, whatever the city)
  old tasks   the fraction of held-out instances of tasks.py's families solved (tasks.correct), without tools and
              with the tools listed (tool_choice="auto": no call wanted)
Writes DIR/tool_eval.json (train.py's card reads it: `train.py --recard DIR --eval-per-task 0`).

    . .venv/bin/activate && python training/eval_tools.py models/mbd-tools-tiny [--n 50]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import TASKS, correct, held_out_set  # noqa: E402
from tool_tasks import held_out_calls, held_out_results, said, tools_for  # noqa: E402

DECODINGS = {
    "greedy, one token per forward": dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0),
    "engine defaults": {},
    "blocks of 4, confidence > 0.9": dict(block_size=4, acceptance="confidence", threshold=0.9),
}


def call_ok(out, fn, city):
    if len(out.tool_calls) != 1:
        return False
    c = out.tool_calls[0]
    try:
        args = json.loads(c.arguments)
    except ValueError:
        return False
    return c.name == fn and args == {"city": city}


def evaluate(eng, n, per_task, params):
    toks = fwd = 0

    def run(msgs, tools, max_tokens):
        nonlocal toks, fwd
        out = eng.chat(msgs, tools=tools, tool_choice="auto" if tools else None, max_tokens=max_tokens, **params)
        toks += out.usage.completion_tokens
        fwd += out.usage.forward_passes
        return out

    calls, named = [], []
    for m, t, fn, c in held_out_calls(n):
        out = run(m, t, 96)
        calls.append(call_ok(out, fn, c))
        named.append([x.name for x in out.tool_calls] == [fn])
    trips, values = [], []
    for m, t, content, words in held_out_results(n):
        out = run(m, t, 64)
        trips.append(not out.tool_calls and said(words, content, out.content or ""))
        values.append(not out.tool_calls and all(str(v) in (out.content or "") for v in json.loads(content).values()))
    import random
    r = random.Random(5)
    old = {"no tools": {k: [0, 0] for k in TASKS}, "tools listed": {k: [0, 0] for k in TASKS}}
    for task, p, a in held_out_set(per_task):
        for key, tools in (("no tools", None), ("tools listed", tools_for(r))):
            out = run([{"role": "user", "content": p}], tools, 40)
            old[key][task][0] += (not out.tool_calls) and correct(task, p, a, out.text)
            old[key][task][1] += 1
    acc = lambda d: sum(v[0] for v in d.values()) / max(1, sum(v[1] for v in d.values()))
    return {"calls": sum(calls) / len(calls), "calls_right_function": sum(named) / len(named),
            "round_trip": sum(trips) / len(trips), "round_trip_values": sum(values) / len(values),
            "old_tasks": acc(old["no tools"]), "old_tasks_tools_listed": acc(old["tools listed"]),
            "old_per_task": {k: v[0] / max(v[1], 1) for k, v in old["no tools"].items()},
            "tokens_per_forward": toks / max(fwd, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=50, help="held-out call requests and round trips per decoding")
    ap.add_argument("--per-task", type=int, default=10, help="held-out instances per old task family")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import mbd_rs
    eng = mbd_rs.Engine.load(args.model)
    res = {}
    for name, params in DECODINGS.items():
        t = time.time()
        res[name] = evaluate(eng, args.n, args.per_task, params)
        print(f"{name} ({time.time() - t:.0f}s): {json.dumps(res[name])}", flush=True)
    out = {"held_out_calls": args.n, "held_out_round_trips": args.n, "old_per_task": args.per_task,
           "mbd_rs": getattr(mbd_rs, "__version__", "?"), "results": res}
    if not args.no_write:
        json.dump(out, open(os.path.join(args.model, "tool_eval.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
