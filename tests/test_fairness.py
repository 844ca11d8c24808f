"""A long prompt's prefill beside other streams (fairness, from the hostile-input work): where a row's result does
not depend on the rows beside it (the default CPU path: matrices packed at load, the blocked attention), the
scheduler cuts the long prompt's chunks so that no tick costs much more than a chunk over no keys; every stream
still gets exactly its lone tokens. (The latency this buys is measured in benches/results/batching-serving.md, not
here.)"""
import threading

import mbd_rs


def test_a_long_prefill_cut_beside_small_streams_changes_no_output(long_context_model):
    # no prefix cache: the same long prompt runs three times, and each must be a whole prefill
    eng = mbd_rs.Engine.load(long_context_model, prefix_cache=0)
    msgs = [{"role": "user", "content": "sort 3 1 2"}]
    small_alone = eng.chat(msgs, max_tokens=8)
    prompt = [87] * 3000
    long_alone = eng.generate(prompt, max_tokens=4)
    f0 = eng.batch_stats[0]
    eng.generate(prompt, max_tokens=4)
    forwards_alone = eng.batch_stats[0] - f0
    out = {}

    def long_run():
        out["long"] = eng.generate(prompt, max_tokens=4)

    f0 = eng.batch_stats[0]
    th = threading.Thread(target=long_run)
    th.start()
    smalls = []
    while th.is_alive():
        smalls.append(eng.chat(msgs, max_tokens=8))
    th.join()
    assert out["long"].token_ids == long_alone.token_ids and out["long"].text == long_alone.text
    assert all(s.token_ids == small_alone.token_ids for s in smalls)
    # the small requests stepped while the prompt was filled: its chunks were cut into more forwards
    assert len(smalls) >= 2
    small_forwards = sum(s.usage.forward_passes for s in smalls)
    assert eng.batch_stats[0] - f0 > forwards_alone, (eng.batch_stats[0] - f0, forwards_alone, small_forwards)
