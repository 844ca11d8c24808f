"""The logits controls (presence_penalty, frequency_penalty, repetition_penalty, logit_bias) and min_p.

Greedy AR with each control equals an independent greedy loop over the model's next-token logits with the control
applied as transformers' processors define it (RepetitionPenaltyLogitsProcessor: a seen token's positive logit
divided by r, a negative one multiplied, over prompt and completion; OpenAI's presence and frequency penalties over
the completion; the bias added), token for token, on random-weight checkpoints of three families. The logits are
`Engine.logits`, which tests/test_parity.py holds to transformers'; with torch installed,
tests/test_transformers_live.py runs transformers' own `generate` with its processors. In multi-block decoding the
controls see the completion committed before each step (docs/decoding.md): batched = lone, a banned token never
appears, and block size 1 of the same definition is the reference loop again."""
import threading

import numpy as np
import pytest

import mbd_rs
from conftest import parity_dir

MASK = 3
EOS = 0
PROMPTS = [[17, 45, 210, 17], [5, 9], [99, 4, 250, 7, 8, 9, 10]]


def causal(name):
    """A random checkpoint as an autoregressive model: causal attention, shifted logits (the row of position i
    predicts i + 1), as transformers' generate reads it."""
    return mbd_rs.Engine.load(parity_dir(name), device="cpu", mask_token_id=MASK, attention="causal",
                              logits_shift=True, eos_token_ids=[EOS])


def controlled(row, ids, prompt_len, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """One next-token row under the controls, by their definitions (float32, as the logits are)."""
    row = row.astype(np.float32).copy()
    for t, b in (bias or {}).items():
        row[int(t)] += np.float32(b)
    if repetition != 1.0:
        seen = np.unique(np.array(ids, dtype=np.int64))
        r = np.float32(repetition)
        s = row[seen]
        row[seen] = np.where(s < 0, s * r, s / r)
    gen = ids[prompt_len:]
    if gen and (presence or frequency):
        toks, counts = np.unique(np.array(gen, dtype=np.int64), return_counts=True)
        row[toks] -= (np.float64(frequency) * counts + presence).astype(np.float32)
    return row


def reference(eng, prompt, n, **controls):
    """Greedy AR: the argmax (lowest id on ties) of the controlled next-token row, until EOS or n tokens."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        row = np.asarray(eng.logits(ids, attention="causal"))[-1]
        t = int(np.argmax(controlled(row, ids, len(prompt), **controls)))
        if t == EOS:
            break
        ids.append(t)
        out.append(t)
    return out


CONTROLS = [
    dict(presence=1.5),
    dict(frequency=0.8),
    dict(repetition=1.6),
    dict(repetition=0.6),
    dict(bias={"17": -100, "42": 6.0}),
    dict(presence=-0.5, frequency=0.4, repetition=1.2, bias={"7": 3.5}),
]


def engine_kw(c):
    kw = {}
    if "presence" in c:
        kw["presence_penalty"] = c["presence"]
    if "frequency" in c:
        kw["frequency_penalty"] = c["frequency"]
    if "repetition" in c:
        kw["repetition_penalty"] = c["repetition"]
    if "bias" in c:
        kw["logit_bias"] = c["bias"]
    return kw


@pytest.mark.parametrize("name", ["qwen3_headdim_gqa", "qwen2_gqa_tied", "qwen3moe_top2_norm"])
def test_greedy_ar_with_each_control_equals_the_reference_loop(name):
    eng = causal(name)
    n = 20
    changed = 0
    for c in CONTROLS:
        for p in PROMPTS:
            want = reference(eng, p, n, **c)
            got = eng.generate(p, max_tokens=n, **engine_kw(c))
            assert got.token_ids == want, (c, p)
            changed += want != reference(eng, p, n)
    assert changed >= len(CONTROLS)  # the controls do change the outputs


def test_a_repetitive_model_stops_repeating():
    """A random model repeats itself; frequency and presence penalties break the loop."""
    eng = causal("qwen3_headdim_gqa")
    plain = eng.generate(PROMPTS[0], max_tokens=24).token_ids
    pen = eng.generate(PROMPTS[0], max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).token_ids
    assert len(set(pen)) > len(set(plain))


@pytest.fixture(scope="module")
def sdar():
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=MASK, attention="block_causal",
                              logits_shift=False, block_size=4)


def _multi_block_requests():
    out = []
    for i in range(8):
        prompt = [(i * 31 + j * 17 + 5) % 200 + 4 for j in range(3 + (i * 7) % 20)]
        kw = dict(max_tokens=[13, 24, 9, 31][i % 4], block_size=[4, 2, 8][i % 3], threshold=[0.9, 0.5, 0.7][i % 3],
                  acceptance="confidence", early_stop=False, seed=i,
                  **engine_kw(CONTROLS[i % len(CONTROLS)]))
        if i % 3 == 1:
            kw.update(temperature=0.8, min_p=0.1)
        out.append((prompt, kw))
    return out


def test_multi_block_controls_are_batching_invariant(sdar):
    reqs = _multi_block_requests()
    alone = [sdar.generate(p, **kw).token_ids for p, kw in reqs]
    got = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def work(i):
        start.wait()
        got[i] = sdar.generate(reqs[i][0], **reqs[i][1]).token_ids

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    f0, s0, _ = sdar.batch_stats
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    f1, s1, _ = sdar.batch_stats
    assert got == alone
    assert s1 - s0 > f1 - f0  # batched


def test_multi_block_bias_bans_a_token_and_penalties_see_committed_tokens(sdar):
    p = [11, 12, 13, 14, 15]
    plain = sdar.generate(p, max_tokens=32, block_size=4, threshold=0.5, early_stop=False).token_ids
    banned = max(set(plain), key=plain.count)
    got = sdar.generate(p, max_tokens=32, block_size=4, threshold=0.5, early_stop=False,
                        logit_bias={str(banned): -100}).token_ids
    assert banned not in got and len(got) == 32
    pen = sdar.generate(p, max_tokens=32, block_size=4, threshold=0.5, early_stop=False, frequency_penalty=2.0,
                        presence_penalty=2.0).token_ids
    assert max(map(pen.count, set(pen))) < max(map(plain.count, set(plain)))


def test_min_p_one_keeps_only_the_most_likely_token(sdar):
    """min_p = 1 leaves the tokens as likely as the most likely one: sampling at any temperature is greedy."""
    p = [21, 22, 23]
    greedy = sdar.generate(p, max_tokens=16, block_size=4, early_stop=False).token_ids
    for seed in range(3):
        assert sdar.generate(p, max_tokens=16, block_size=4, early_stop=False, temperature=1.5, min_p=1.0,
                             seed=seed).token_ids == greedy
    wide = {tuple(sdar.generate(p, max_tokens=16, block_size=4, early_stop=False, temperature=1.5, min_p=0.0,
                                seed=seed).token_ids) for seed in range(3)}
    assert wide != {tuple(greedy)}


@pytest.mark.parametrize("kw,msg", [
    (dict(presence_penalty=0.5, speculative="s2d2"),
     "presence_penalty does not combine with speculative='s2d2' in this version"),
    (dict(logit_bias={"320": 1}), "logit_bias: token id 320 is out of range: the vocabulary has 320 tokens"),
    (dict(logit_bias={"-1": 1}), "logit_bias: key \"-1\" is not a token id"),
    (dict(logit_bias={"1": float("nan")}), "logit_bias must be a JSON"),
    (dict(logit_bias="[1, 2]"), "logit_bias must be an object"),
    (dict(repetition_penalty=0), "repetition_penalty must be between 0.01 and 100, got 0"),
    (dict(presence_penalty=-3), "presence_penalty must be between -2 and 2, got -3"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
])
def test_bad_controls_are_clear_errors(sdar, kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError) as e:
        sdar.generate([5, 6], max_tokens=4, **kw)
    assert msg in str(e.value)
