"""The 2026 acceptance rules (issue #53) beyond the reference parity (tests/test_decode_parity.py, which checks
BACD, CreditDecoding and DUS token for token and forward for forward against tests/reference/decoder.py): the
parity cases are sensitive to what each rule adds, each rule reaches the CLI's derived flags, and the parameters
that do not apply get clear errors."""
import json
import subprocess
import sys

import pytest

import mbd_rs
from conftest import parity_dir
from reference.decoder import dus_levels
from test_decode_parity import CASES, run


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
    (dict(acceptance="credit", credit_alpha=-1.0), "credit_alpha must be >= 0"),
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
        r = subprocess.run([sys.executable, "-m", "mbd_rs", "generate", "abc", "--model", d, "--device", "cpu",
                            "--mask-token-id", "3", "--max-tokens", "10", "--json", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == want.token_ids and out["usage"]["forward_passes"] == want.usage.forward_passes
