"""asyncio, native: `async for` over a Stream and Engine.astream/agenerate/achat run on one event loop with no
thread per stream (the loop watches a descriptor the scheduler makes readable). Many concurrent streams are batched
and each equals its lone run; the loop stays free while they run; a cancelled task's generation leaves at once;
errors come out as in the blocking API."""
import asyncio
import threading

import pytest

import mbd_rs
from conftest import parity_dir
from test_batching import _requests, _run


@pytest.fixture(scope="module")
def sdar():
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, attention="block_causal",
                              logits_shift=False, block_size=4)


@pytest.fixture(scope="module")
def tiny():
    return mbd_rs.Engine.load()


async def _streamed(eng, prompt, kw):
    s = eng.stream(prompt, **kw)
    ids, text = [], ""
    async for ch in s:
        ids += ch.token_ids
        text += ch.text
    assert ids == s.token_ids and text == s.text
    return s.token_ids, s.text, s.finish_reason, s.usage.forward_passes


def test_concurrent_async_streams_equal_their_lone_runs(sdar):
    reqs = _requests(12)
    alone = [_run(sdar, p, kw) for p, kw in reqs]
    threads_before = threading.active_count()

    async def main():
        return await asyncio.gather(*[_streamed(sdar, p, kw) for p, kw in reqs])

    f0, s0, _ = sdar.batch_stats
    got = asyncio.run(main())
    f1, s1, _ = sdar.batch_stats
    assert got == alone
    assert s1 - s0 > f1 - f0 > 0  # batched
    assert threading.active_count() <= threads_before + 1  # no thread per stream (the scheduler may start one)


def test_agenerate_and_achat_equal_generate_and_chat(tiny):
    msgs = [{"role": "user", "content": "sort 7 2 9"}]

    async def main():
        c, g = await asyncio.gather(tiny.achat(msgs, max_tokens=16), tiny.agenerate("reverse a b c", max_tokens=16))
        s = await tiny.astream("repeat ab 3", max_tokens=16)
        return c, g, await s.aresult()

    c, g, r = asyncio.run(main())
    assert c.token_ids == tiny.chat(msgs, max_tokens=16).token_ids and c.text == "2 7 9"
    assert g.token_ids == tiny.generate("reverse a b c", max_tokens=16).token_ids
    assert r.token_ids == tiny.generate("repeat ab 3", max_tokens=16).token_ids
    assert r.usage is not None and r.finish_reason == "stop"


def test_the_event_loop_runs_while_streams_wait(sdar):
    """A ticker on the same loop keeps running between the chunks of a long generation: waiting for the next chunk
    yields to the loop rather than blocking it (a blocking wait would leave the ticker at 0 until the end)."""
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        s = sdar.stream([5, 6, 7], max_tokens=96, block_size=4, threshold=1.0, early_stop=False)
        seen = []
        async for _ in s:
            seen.append(ticks)
        t.cancel()
        return seen, s.usage.forward_passes

    seen, forwards = asyncio.run(main())
    # (a reader that falls behind gets several forwards' tokens in one chunk: fewer chunks than forwards)
    assert forwards >= 24 and len(seen) >= 2
    assert seen[-1] >= len(seen)  # the ticker ran at least once a chunk on average
    assert len(set(seen)) >= len(seen) // 2  # and between most chunks


async def _after_first_forward(eng, f0):
    for _ in range(100_000):
        if eng.batch_stats[0] > f0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("no forward ran")


LONG = dict(max_tokens=240, block_size=1, threshold=1.0, early_stop=False)  # 240 forwards on a 256-token context


def test_a_cancelled_task_frees_its_place_at_once(sdar):
    """One place (max_batch=1): a long generation's task is cancelled, and the next request is served at once
    rather than after the long one's hundreds of forwards."""
    sdar.set_batching(max_batch=1)
    try:
        async def main():
            f0 = sdar.batch_stats[0]
            long = asyncio.create_task(sdar.agenerate([5, 6, 7], **LONG))
            await _after_first_forward(sdar, f0)
            assert not long.done()
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long
            f1 = sdar.batch_stats[0]
            nxt = await asyncio.wait_for(sdar.agenerate([8, 9], max_tokens=4, early_stop=False), 60)
            return nxt, f1 - f0

        nxt, ran = asyncio.run(main())
        assert ran < 240  # the long one was stopped part way
        assert nxt.finish_reason in ("length", "stop") and 0 < nxt.usage.completion_tokens <= 4
        f0, _, _ = sdar.batch_stats
        asyncio.run(asyncio.sleep(0.3))
        assert sdar.batch_stats[0] == f0  # the cancelled generation runs no more forwards
    finally:
        sdar.set_batching(max_batch=64)


def test_a_cancelled_stream_iteration_closes_the_stream(sdar):
    async def main():
        s = sdar.stream([5, 6, 7], **LONG)
        first = asyncio.Event()

        async def read():
            async for _ in s:
                first.set()

        t = asyncio.create_task(read())
        await first.wait()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return s

    s = asyncio.run(main())
    assert s.finish_reason is None and len(s.token_ids) < 240
    with pytest.raises(mbd_rs.InvalidRequestError, match="closed before it finished"):
        s.result()


def test_errors_and_loops(tiny):
    async def bad():
        return await tiny.agenerate("hi", max_tokens=-1)

    with pytest.raises((mbd_rs.InvalidRequestError, TypeError, ValueError)):
        asyncio.run(bad())
    # one engine on one loop after another (each loop has its own wake line), and blocking use in between
    for _ in range(2):
        assert asyncio.run(tiny.agenerate("sort 3 1 2", max_tokens=8)).text == "1 2 3"
        assert tiny.generate("sort 3 1 2", max_tokens=8).text == "1 2 3"


def test_async_and_blocking_readers_share_one_engine(tiny):
    """Streams read with `async for` on a loop and with plain iteration on threads at the same time."""
    qs = ["sort 7 2 9", "reverse a b c d", "repeat ab 3", "add 123+456"]
    alone = [tiny.generate(q, max_tokens=24).text for q in qs]
    out = [None] * len(qs)

    def blocking(i):
        out[i] = tiny.generate(qs[i], max_tokens=24).text

    ts = [threading.Thread(target=blocking, args=(i,)) for i in (0, 1)]
    [t.start() for t in ts]

    async def main():
        return await asyncio.gather(*[tiny.agenerate(qs[i], max_tokens=24) for i in (2, 3)])

    got = asyncio.run(main())
    [t.join(60) for t in ts]
    out[2], out[3] = got[0].text, got[1].text
    assert out == alone
