"""An asyncio service around one Engine: FastAPI routes that await `Engine.achat` and stream with `async for`,
with no thread per request. Concurrent requests are batched into one forward per step; a client that goes away
cancels its generation.

    python examples/fastapi_app.py [model]          # runs four requests against the app in-process
    uvicorn examples.fastapi_app:app                # or serve it (the embedded model)
"""
import asyncio
import sys

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mbd_rs import Engine

eng = Engine.load(sys.argv[1] if len(sys.argv) > 1 and __name__ == "__main__" else None)
app = FastAPI()


class Ask(BaseModel):
    question: str
    max_tokens: int = 32


@app.post("/ask")
async def ask(q: Ask) -> dict:
    c = await eng.achat([{"role": "user", "content": q.question}], max_tokens=q.max_tokens)
    return {"answer": c.text, "tokens_per_forward": c.usage.tokens_per_forward}


@app.post("/ask/stream")
async def ask_stream(q: Ask) -> StreamingResponse:
    stream = await eng.astream_chat([{"role": "user", "content": q.question}], max_tokens=q.max_tokens)

    async def text():  # Starlette cancels this when the client leaves: the stream is then closed
        async for chunk in stream:
            yield chunk.text

    return StreamingResponse(text(), media_type="text/plain")


async def main() -> None:
    questions = ["sort 7 2 9", "reverse a b c d", "repeat ab 3", "add 123+456"]
    alone = [eng.chat([{"role": "user", "content": q}], max_tokens=32).text for q in questions]
    before = eng.batch_stats
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        replies = await asyncio.gather(*[client.post("/ask", json={"question": q}) for q in questions])
        streamed = await client.post("/ask/stream", json={"question": "sort 5 3 8 1"})
    forwards, steps, _ = (a - b for a, b in zip(eng.batch_stats, before))
    answers = [r.json()["answer"] for r in replies]
    for q, a in zip(questions, answers):
        print(f"{q:18s} -> {a}")
    print(f"streamed: sort 5 3 8 1 -> {streamed.text}")
    print(f"the same answers as alone: {answers == alone}; {steps} stream steps in {forwards} forwards")


if __name__ == "__main__":
    asyncio.run(main())
