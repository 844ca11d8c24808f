"""Long calls stop when asked: a CancelToken stops Engine.logits / prompt_logprobs within a chunk of work (a
query chunk or kernel task of a long window's attention), a stream's cancel() stops a long prefill or a no-cache
recompute at once, and Ctrl-C (SIGINT) interrupts a waiting logits call or stream read (KeyboardInterrupt, the
generation cancelled)."""
import signal
import subprocess
import sys
import threading
import time

import pytest

import mbd_rs



def timed_cancel(call, after=0.3):
    tok = mbd_rs.CancelToken()
    threading.Timer(after, tok.cancel).start()
    t0 = time.perf_counter()
    with pytest.raises(mbd_rs.RequestCancelledError, match="cancelled"):
        call(tok)
    return time.perf_counter() - t0


@pytest.mark.parametrize("kw", [dict(attention="full"), dict(attention="block_causal")])
def test_a_cancel_token_stops_logits_within_a_chunk(long_context_model, kw):
    eng = mbd_rs.Engine.load(long_context_model)
    # the whole call takes tens of seconds here (8000 positions, O(n^2) attention); cancelled at 0.3 s
    took = timed_cancel(lambda tok: eng.logits([87] * 8000, cancel=tok, **kw))
    assert took < 3.0, took
    # a token cancelled before the call stops it at once; the engine is fine afterwards
    tok = mbd_rs.CancelToken()
    tok.cancel()
    assert tok.cancelled
    with pytest.raises(mbd_rs.RequestCancelledError):
        eng.logits([87] * 100, cancel=tok)
    assert eng.logits([87, 5]).shape == (2, eng.info.vocab_size)


def test_a_cancel_token_stops_prompt_logprobs(long_context_model):
    eng = mbd_rs.Engine.load(long_context_model)
    assert timed_cancel(lambda tok: eng.prompt_logprobs([87] * 8000, cancel=tok)) < 3.0


@pytest.mark.parametrize("kw", [dict(use_cache=False), dict()])
def test_stream_cancel_stops_a_long_prefill_or_recompute(long_context_model, kw):
    eng = mbd_rs.Engine.load(long_context_model)
    s = eng.stream([87] * 6000, max_tokens=64, early_stop=False, **kw)  # not ended by its first EOS
    threading.Timer(0.3, s.cancel).start()
    t0 = time.perf_counter()
    chunks = list(s)
    assert time.perf_counter() - t0 < 3.0
    assert s.finish_reason == "cancelled" and chunks[-1].finish_reason == "cancelled"
    # the scheduler goes on with the next request
    assert eng.generate("sort 3 1 2", max_tokens=8).finish_reason in ("stop", "length")


SIGINT_CHILD = r"""
import json, os, shutil, sys, tempfile, time
import mbd_rs
eng = mbd_rs.Engine.load(sys.argv[1])
print("ready", flush=True)
t0 = time.perf_counter()
try:
    if sys.argv[2] == "logits":
        eng.logits([87] * 8000, attention="full")
    else:
        for _ in eng.stream([87] * 8000, max_tokens=64, use_cache=False, early_stop=False):
            pass
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {time.perf_counter() - t0:.2f}", flush=True)
    # the engine still serves
    print("after", eng.generate("sort 3 1 2", max_tokens=8).finish_reason, flush=True)
"""


@pytest.mark.parametrize("what", ["logits", "stream"])
def test_ctrl_c_interrupts_a_long_call(long_context_model, what):
    p = subprocess.Popen([sys.executable, "-c", SIGINT_CHILD, long_context_model, what], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert time.perf_counter() - t0 < 5.0, (out, err)
    lines = out.split("\n")
    assert lines[0].startswith("interrupted"), (out, err)
    assert lines[1] in ("after stop", "after length"), (out, err)
