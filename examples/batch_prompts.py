"""Many prompts at once: an Engine is shared by threads, and its scheduler batches their streams into one forward
per step (continuous batching). Every answer is exactly what it would be alone.

    python examples/batch_prompts.py [model]
"""
import sys
from concurrent.futures import ThreadPoolExecutor

from mbd_rs import Engine

eng = Engine.load(sys.argv[1] if len(sys.argv) > 1 else None)
questions = ["sort 7 2 9", "reverse a b c d", "repeat ab 3", "add 123+456", "hello Grace", "sort 5 3 8 1"]


def ask(q: str) -> str:
    return eng.chat([{"role": "user", "content": q}], max_tokens=32).text


alone = [ask(q) for q in questions]
before = eng.batch_stats
with ThreadPoolExecutor(len(questions)) as pool:
    together = list(pool.map(ask, questions))
forwards, steps, _ = (a - b for a, b in zip(eng.batch_stats, before))
for q, a in zip(questions, together):
    print(f"{q:18s} -> {a}")
print(f"the same answers as alone: {together == alone}; {steps} stream steps in {forwards} forwards")
