"""Stopping work: a stream's cancel() ends its generation at the next forward; a CancelToken stops a long
`logits` / `prompt_logprobs` call from another thread (and Ctrl-C stops either at once).

    python examples/cancel.py
"""
import threading

from mbd_rs import CancelToken, Engine, RequestCancelledError

eng = Engine.load()
stream = eng.stream_chat([{"role": "user", "content": "repeat ab 3"}], max_tokens=64)
for _ in stream:
    stream.cancel()  # after the first chunk
print("stream:", stream.finish_reason)

token = CancelToken()
threading.Timer(0.05, token.cancel).start()
try:
    eng.logits(list(range(4, 90)) * 2, attention="full", cancel=token)
    print("logits: finished before the cancel")
except RequestCancelledError as e:
    print("logits:", e)
