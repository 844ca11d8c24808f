"""Writes benches/lm_eval/mbd_tiny_heldout.jsonl: the held-out items of the embedded mbd-tiny model that
benches/eval_tiny.py scores (training/tasks.py `held_out_set(40)`, its default --per-task), keeping the first
`--per-task` items of each task family in that list's order (a subset of exactly eval_tiny's items; the `hello`
family has only 3 distinct held-out inputs). One JSON object per line:

    task      the task family (sort, reverse, add, repeat, count, hello)
    prompt    the chat task text: the user message's content, as eval_tiny.py sends it
    rendered  that message rendered by the model's chat template with the generation prompt (for /v1/completions)
    answer    the expected answer; scored by exact match, no normalisation (eval_tiny.py: `c.text == a`)

    python benches/lm_eval/make_data.py [--per-task 20] [--out FILE]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "training"))
from tasks import held_out_set, render  # noqa: E402

EVAL_TINY_PER_TASK = 40  # benches/eval_tiny.py's default --per-task
DEFAULT_OUT = os.path.join(HERE, "mbd_tiny_heldout.jsonl")


def items(per_task):
    """(task, prompt, answer) triples: the first `per_task` of each family in eval_tiny's held-out list."""
    kept, out = {}, []
    for task, p, a in held_out_set(EVAL_TINY_PER_TASK):
        if kept.get(task, 0) < per_task:
            kept[task] = kept.get(task, 0) + 1
            out.append((task, p, a))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = items(args.per_task)
    with open(args.out, "w") as f:
        for task, p, a in rows:
            f.write(json.dumps(dict(task=task, prompt=p, rendered=render(p), answer=a)) + "\n")
    print(f"wrote {len(rows)} items to {args.out}")


if __name__ == "__main__":
    main()
