"""Structured outputs: a pydantic object out of a chat, and a regex-held answer, on any decoding mode.

    python examples/structured_outputs.py            # the embedded model
    python examples/structured_outputs.py org/name   # a Hub id or a local directory

The embedded model was never taught JSON, so its object holds what it can; the grammar makes it valid anyway.
"""
import sys
from typing import Annotated, List

from pydantic import BaseModel, Field

from mbd_rs import Engine


class Answer(BaseModel):
    numbers: List[Annotated[int, Field(ge=0, le=9)]] = Field(min_length=1, max_length=4)
    done: bool


eng = Engine.load(sys.argv[1] if len(sys.argv) > 1 else None)
ask = [{"role": "user", "content": "sort 5 3 8 1"}]
for mode in (dict(block_size=1), dict(), dict(temperature=0.8, seed=1)):  # AR, multi-block, sampled
    out = eng.chat(ask, max_tokens=64, response_format=Answer, **mode)
    answer = Answer.model_validate_json(out.text)  # always parses: the grammar held every step
    u = out.usage
    print(f"{answer!r:48} {u.completion_tokens} tokens, {u.forward_passes} forwards, {u.forced_tokens} forced")
digits = eng.chat(ask, max_tokens=16, regex=r"[0-9]( [0-9])*")
print(f"regex: {digits.text!r} in {digits.usage.forward_passes} forwards")
