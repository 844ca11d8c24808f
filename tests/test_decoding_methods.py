"""The acceptance rules of 2026 (BACD, CreditDecoding, DUS) beyond the reference parity (tests/test_decode_parity.py,
which checks BACD, CreditDecoding and DUS token for token and forward for forward against tests/reference/decoder.py):
the parity cases are sensitive to what each rule adds, each rule reaches the CLI's derived flags, and the parameters
that do not apply get clear errors."""
import json

import pytest

import mbd_rs
from conftest import parity_dir, run_concurrently
from fixture_params import generate_kwargs
from reference.decoder import dus_levels
from test_cli import cli
from test_decode_parity import CASES, engine, run


def _case(variant):
    return next(c for c in CASES if c["variant"] == variant)


@pytest.mark.parametrize("variant", ["credit_strong_multiblock", "credit_single_block", "credit_shifted_eos"])
def test_credit_parity_cases_depend_on_the_credit(variant):
    """With the credit's fusion turned off (alpha 0) the same cases decode differently somewhere: the parity
    cases check the credit, not only the threshold rule."""
    differ = 0
    for c in (c for c in CASES if c["variant"] == variant):
        plain = dict(c, params=dict(c["params"], credit=dict(c["params"]["credit"], alpha=0.0)))
        out = run(plain, True)
        differ += (out.token_ids, out.usage.forward_passes) != (c["completion"], c["forward_passes"])
    assert differ > 0


def test_dus_takes_one_forward_per_level():
    """A single block of 8 takes log2(8) = 3 forwards per block, whatever the confidences."""
    c = _case("dus_single_block_b8")
    out = run(c, True)
    assert out.usage.forward_passes == c["forward_passes"]
    lp = len(c["prompt"])
    # blocks on the absolute grid of 8: the prompt's tail, then whole blocks, the last cut at max_tokens
    ends = sorted({min((p // 8 + 1) * 8, lp + c["max_tokens"]) for p in range(lp, lp + c["max_tokens"])})
    starts = [lp] + ends[:-1]
    want = sum(sum(1 for lv in dus_levels(e - s // 8 * 8) if any(s <= s // 8 * 8 + o < e for o in lv))
               for s, e in zip(starts, ends))
    assert c["forward_passes"] == want


@pytest.fixture(scope="module")
def eng():
    return mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), device="cpu", mask_token_id=3)


@pytest.mark.parametrize("kw,msg", [
    (dict(bacd_lower=0.5), "bacd_lower only applies with acceptance='bacd'"),
    (dict(acceptance="confidence", credit_beta=0.5, credit_alpha=1.0),
     "credit_alpha, credit_beta only apply with acceptance='credit'"),
    (dict(acceptance="bacd", threshold=0.5), "threshold does not apply with acceptance='bacd'"),
    (dict(acceptance="dus", threshold=0.5), "threshold does not apply with acceptance='dus'"),
    (dict(acceptance="bacd", bacd_lower=0.8, bacd_upper=0.7), r"bacd_lower \(0.8\) must not exceed bacd_upper"),
    (dict(acceptance="bacd", bacd_upper=1.5), "bacd_upper must be in"),
    (dict(acceptance="credit", credit_beta=2.0), "credit_beta must be in"),
    (dict(acceptance="credit", credit_alpha=-1.0), "credit_alpha must be between 0 and 1000, got -1"),
    (dict(acceptance="credit", credit_alpha=1e308), "credit_alpha must be between 0 and 1000, got 1e308"),
    (dict(acceptance="greedy"), "acceptance must be"),
])
def test_bad_method_parameters(eng, kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        eng.generate([5, 6], max_tokens=4, block_size=4, **kw)


def test_methods_from_the_command_line():
    d = parity_dir("qwen2_gqa_tied")
    e = mbd_rs.Engine.load(d, device="cpu", mask_token_id=3)
    for flags, kw in [(["--acceptance", "bacd", "--bacd-lower", "0.1", "--bacd-upper", "0.5"],
                       dict(acceptance="bacd", bacd_lower=0.1, bacd_upper=0.5)),
                      (["--acceptance", "credit", "--credit-alpha", "2", "--threshold", "0.3"],
                       dict(acceptance="credit", credit_alpha=2.0, threshold=0.3)),
                      (["--acceptance", "dus", "--block-size", "8"], dict(acceptance="dus", block_size=8))]:
        want = e.generate("abc", max_tokens=10, **kw)
        r = cli("generate", "abc", "--model", d, "--device", "cpu", "--mask-token-id", "3", "--max-tokens", "10",
                "--json", *flags)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == want.token_ids and out["usage"]["forward_passes"] == want.usage.forward_passes


def test_methods_batched_equal_lone_runs(eng):
    """BACD's per-block history, the credit and DUS's schedule are each generation's own: streams batched together
    (with each other, plain confidence and S2D2) give exactly what each gives alone."""
    reqs = []
    for i in range(8):
        prompt = [(i * 37 + j * 11 + 5) % 250 + 4 for j in range(2 + (i * 5) % 17)]
        kw = dict(max_tokens=[13, 6, 21, 9][i % 4], block_size=[4, 8][i % 2], early_stop=False, seed=i,
                  use_cache=(i % 3 != 2), block_add_threshold=[1.0, 0.3][i % 2])
        kw.update([dict(acceptance="bacd", bacd_lower=0.01, bacd_upper=0.05),
                   dict(acceptance="credit", threshold=0.05, credit_alpha=2.0),
                   dict(acceptance="dus"),
                   dict(acceptance="confidence", threshold=0.05, speculative="s2d2", verify_policy="always")][i % 4])
        if i % 3 == 1:
            kw["temperature"] = 0.8
        reqs.append((prompt, kw))

    def go(prompt, kw):
        c = eng.generate(prompt, **kw)
        return c.token_ids, c.usage.forward_passes

    assert run_concurrently(go, reqs) == [go(p, kw) for p, kw in reqs]


def test_tccf_text_is_the_thinking_then_the_check_then_the_answer():
    """The completion holds the thinking up to (not including) the trigger, the check text, then the answer,
    decoded at the answer's block size; the parity cases (test_decode_parity.py, tccf_*) pin the tokens."""
    c = _case("tccf_b1_multiblock")
    t = c["params"]["tccf"]
    out = run(c, True)
    e = out.token_ids.index(t["check"][0])
    assert t["trigger"] not in out.token_ids[:e]
    assert out.token_ids[e:e + len(t["check"])] == t["check"]
    # up to the trigger the thinking is plain decoding with the trigger as an end of text
    p = c["params"]
    eng = engine(c["model"], p["attention"], p["alignment"], p["logits_shift"], tuple(c["eos_token_ids"] + [t["trigger"]]))
    think = eng.generate(c["prompt"], max_tokens=c["max_tokens"], **generate_kwargs({**p, "tccf": None}))
    assert out.token_ids[:e] == think.token_ids


@pytest.mark.parametrize("kw,msg", [
    (dict(tccf_check="x"), "tccf_check only applies with tccf=True"),
    (dict(tccf=True, tccf_trigger="abcdefgh ijk"), "must be one token of this model's vocabulary"),
    (dict(tccf=True, tccf_trigger="a", speculative="s2d2"), "tccf does not combine with speculative='s2d2'"),
    (dict(tccf=True, tccf_trigger="a", logprobs=1), "tccf does not combine with logprobs"),
    (dict(tccf=True, tccf_trigger="a", tccf_answer_block_size=0), "tccf_answer_block_size must be >= 1"),
])
def test_bad_tccf_parameters(eng, kw, msg):
    with pytest.raises(mbd_rs.InvalidRequestError, match=msg):
        eng.generate([5, 6], max_tokens=4, **kw)


def test_tccf_needs_block_boundaries():
    full = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), device="cpu", mask_token_id=3, attention="full")
    with pytest.raises(mbd_rs.InvalidRequestError, match="needs block-causal or causal attention"):
        full.generate([5, 6], max_tokens=4, tccf=True)
