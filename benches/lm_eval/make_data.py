"""Writes benches/lm_eval/mbd_tiny_heldout.jsonl: the held-out items of the embedded mbd-tiny model that
benches/decoding/eval_tiny.py scores (training/tasks.py `held_out_set(40)`, its default --per-task), keeping the first
`--per-task` items of each task family in that list's order (a subset of exactly eval_tiny's items; `shuffle` is
left out: its instances have many right answers). One JSON object per line:

    task      the task family (sort, reverse, add, repeat, count, hello)
    prompt    the chat task text: the user message's content, as eval_tiny.py sends it
    rendered  that message rendered by the model's chat template with the generation prompt (for /v1/completions)
    answer    the expected answer; scored by exact match, no normalisation (training/tasks.py `correct()` for
              these families)
    choices   the answer and up to 3 near misses (distractors(): the input as given, an off-by-one, a swap, ...),
              in a fixed shuffled order, for the loglikelihood task (mbd_tiny_choice.yaml)
    gold      the answer's index in choices
    continuations  each choice followed by the end-of-turn token <|im_end|> (what the loglikelihood task scores:
              without it a choice that is a prefix of the answer, e.g. "m j g" for "m j g z", would score as high)

    python benches/lm_eval/make_data.py [--per-task 20] [--out FILE]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "training"))
from tasks import MANY_ANSWERS, held_out_set, render  # noqa: E402

EVAL_TINY_PER_TASK = 40  # benches/decoding/eval_tiny.py's default --per-task
DEFAULT_OUT = os.path.join(HERE, "mbd_tiny_heldout.jsonl")
END = "<|im_end|>"  # the chat template's end of turn (the model's EOS)


def distractors(task, prompt, answer):
    """Near misses of `answer` for a multiple-choice item (deterministic; never equal to the answer)."""
    words = answer.split()
    args = prompt.split()[1:]
    if task in ("sort", "reverse"):
        swapped = words[1::-1] + words[2:] if len(words) > 1 else words
        cands = [" ".join(args), " ".join(swapped), " ".join(words[:-1])]
        if task == "sort":
            cands[2] = " ".join(reversed(words))
    elif task in ("add", "count"):
        v = int(answer)
        cands = [str(v + 1), str(max(v - 1, 0)), str(v + 10)]
    elif task == "repeat":
        w, n = args[0], int(args[1])
        cands = [" ".join([w] * (n + 1)), " ".join([w] * (n - 1)), w + w]
    else:  # hello
        name = prompt.split()[1]
        cands = [f"Hello, {name}!", f"Hi, {name}! Nice to meet you.", f"Hello, {name}! Nice to see you."]
    out = []
    for c in cands:
        if c and c != answer and c not in out:
            out.append(c)
    return out


def choice_fields(task, prompt, answer):
    """`choices` (the answer among its distractors, shuffled by a hash of the prompt) and `gold`."""
    choices = [answer] + distractors(task, prompt, answer)
    k = sum(map(ord, prompt)) % len(choices)
    choices = choices[k:] + choices[:k]
    return dict(choices=choices, gold=choices.index(answer), continuations=[c + END for c in choices])


def row(task, prompt, answer):
    return dict(task=task, prompt=prompt, rendered=render(prompt), answer=answer, **choice_fields(task, prompt, answer))


def items(per_task):
    """(task, prompt, answer) triples: the first `per_task` of each family in eval_tiny's held-out list (families
    with one right answer only: exact match and multiple choice need one)."""
    kept, out = {}, []
    for task, p, a in held_out_set(EVAL_TINY_PER_TASK):
        if task not in MANY_ANSWERS and kept.get(task, 0) < per_task:
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
            f.write(json.dumps(row(task, p, a)) + "\n")
    print(f"wrote {len(rows)} items to {args.out}")


if __name__ == "__main__":
    main()
