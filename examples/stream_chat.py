"""Stream a chat answer token by token.

    python examples/stream_chat.py                      # the embedded model
    python examples/stream_chat.py org/name "question"  # a Hub id or a local directory
"""
import sys

from mbd_rs import Engine

model = sys.argv[1] if len(sys.argv) > 1 else None  # None: the embedded mbd-tiny model
question = sys.argv[2] if len(sys.argv) > 2 else "sort 7 2 9 4 1"
eng = Engine.load(model)
stream = eng.stream_chat([{"role": "user", "content": question}], max_tokens=64)
for chunk in stream:
    print(chunk.text, end="", flush=True)
print()
u = stream.usage
assert u is not None
print(f"[{u.completion_tokens} tokens in {u.forward_passes} forwards: {u.tokens_per_forward:.1f} tokens/forward]")
