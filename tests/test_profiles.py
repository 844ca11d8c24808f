"""Family detection from config.json and user overrides at load time."""
import json

import pytest

import mbd_rs
from conftest import parity_dir

# an SDAR checkpoint: a Qwen3 one with SDAR's architecture, block size and mask token
SDAR = dict(architectures=["SDARForCausalLM"], model_type="sdar", block_size=4, mask_token_id=3)


def test_plain_qwen_is_a_causal_lm():
    i = mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied")).info
    assert (i.family, i.arch, i.attention, i.logits_shift) == ("qwen2", "qwen2", "causal", True)
    assert i.eos_token_ids == [0] and i.vocab_size == 320 and i.num_layers == 2
    assert i.num_parameters == 82496  # transformers' own count for this checkpoint (tied head stored once)
    assert i.weight_bytes == 4 * 82496  # an f32 checkpoint is held as f32, the tied head once


def test_moe_info():
    i = mbd_rs.Engine.load(parity_dir("qwen3moe_top2_norm")).info
    assert (i.arch, i.num_experts, i.num_experts_per_tok) == ("qwen3_moe", 6, 2)


def test_sdar_profile(model_copy):
    d = model_copy("qwen3_headdim_gqa", edit_config=lambda c: c.update(SDAR))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    i = mbd_rs.Engine.load(d).info
    assert (i.family, i.arch, i.attention, i.alignment, i.logits_shift) == ("sdar", "qwen3", "block_causal", "absolute", False)
    assert (i.block_size, i.mask_token_id) == (4, 3)
    assert i.eos_token_ids == [0, 2]  # union of config (0) and generation_config ([2, 0])


def test_dream_profile(model_copy):
    d = model_copy("qwen2_mha_untied", edit_config=lambda c: c.update(
        architectures=["DreamModel"], model_type="Dream", mask_token_id=3))
    i = mbd_rs.Engine.load(d).info
    assert (i.family, i.attention, i.logits_shift, i.mask_token_id) == ("dream", "full", True, 3)


def test_fast_dllm_profile_mask_from_tokenizer(model_copy):
    d = model_copy("qwen2_mha_untied", edit_config=lambda c: c.update(
        architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=8))
    i = mbd_rs.Engine.load(d).info
    # The fixture tokenizer defines <|mask|> = 3; config.json has no mask_token_id.
    assert (i.family, i.attention, i.logits_shift, i.block_size, i.mask_token_id) == ("fast_dllm_v2", "block_causal", True, 8, 3)


def test_overrides_win(model_copy):
    i = mbd_rs.Engine.load(parity_dir("qwen3_headdim_gqa"), mask_token_id=3, block_size=16, attention="block_causal",
                           alignment="prompt", logits_shift=False, eos_token_ids=[1, 2]).info
    assert (i.mask_token_id, i.block_size, i.attention, i.alignment, i.logits_shift, i.eos_token_ids) == (
        3, 16, "block_causal", "prompt", False, [1, 2])


def test_profile_attention_is_the_default_for_logits(model_copy):
    import numpy as np
    d = model_copy("qwen3_headdim_gqa", edit_config=lambda c: c.update(SDAR))
    eng = mbd_rs.Engine.load(d)
    exp = np.load(f"{parity_dir('qwen3_headdim_gqa')}/expected.npz")
    got = eng.logits(exp["ids"])
    assert np.abs(got - exp["block4_absolute"]).max() / np.abs(exp["block4_absolute"]).max() <= 1e-4


def test_tokenize_roundtrip():
    eng = mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"))
    ids = eng.tokenize("sort 3 1 2 -> 1 2 3")
    assert len(ids) > 3 and all(isinstance(t, int) for t in ids)
    assert eng.detokenize(ids) == "sort 3 1 2 -> 1 2 3"


def _defaults(i):
    return (i.default_acceptance, i.default_threshold, i.default_block_add_threshold,
            i.default_decoded_token_threshold, i.default_forced_progress, i.default_sub_block_size)


def test_family_decoding_defaults_are_the_authors(model_copy):
    """ModelInfo's default_* fields, per family, against the authors' scripts: SDAR/TraDo decode one block at a
    time with confidence 0.9; Fast-dLLM v2 the same with sub-blocks of 8 (small_block_size); d3LLM's multi-block
    decoder entropy 0.5, alpha 0.1, beta 0.95 (the embedded model is d3LLM-style)."""
    sdar = model_copy("qwen3_headdim_gqa", edit_config=lambda c: c.update(SDAR))
    assert _defaults(mbd_rs.Engine.load(sdar).info) == ("confidence", 0.9, 1.0, 0.95, "first", None)
    fast = model_copy("qwen2_mha_untied", edit_config=lambda c: c.update(
        architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=16))
    assert _defaults(mbd_rs.Engine.load(fast).info) == ("confidence", 0.9, 1.0, 0.95, "first", 8)
    assert _defaults(mbd_rs.Engine.load().info) == ("entropy", 0.5, 0.1, 0.95, "first", None)


@pytest.mark.parametrize("model", [None, "sdar"])
def test_a_request_that_leaves_the_defaults_unset_decodes_with_info_defaults(model, model_copy):
    if model == "sdar":
        model = model_copy("qwen3_headdim_gqa", edit_config=lambda c: c.update(SDAR))
    eng = mbd_rs.Engine.load(model)
    i = eng.info
    text = "sort 7 2 9 4 1 3 8"
    prompt = eng.chat_ids([{"role": "user", "content": text}]) if i.chat_template else eng.tokenize(text)
    unset = eng.generate(prompt, max_tokens=24, early_stop=False)
    explicit = eng.generate(prompt, max_tokens=24, early_stop=False, acceptance=i.default_acceptance,
                            threshold=i.default_threshold, block_add_threshold=i.default_block_add_threshold,
                            decoded_token_threshold=i.default_decoded_token_threshold,
                            forced_progress=i.default_forced_progress)
    assert explicit.token_ids == unset.token_ids
    assert explicit.usage.forward_passes == unset.usage.forward_passes
    # ... and the parameters matter here: accepting every prediction, or none beyond forced progress, changes the
    # number of forwards
    eager = eng.generate(prompt, max_tokens=24, early_stop=False, acceptance="confidence", threshold=0.0)
    strict = eng.generate(prompt, max_tokens=24, early_stop=False, acceptance="confidence", threshold=1.0)
    assert eager.usage.forward_passes <= unset.usage.forward_passes <= strict.usage.forward_passes
    assert eager.usage.forward_passes < strict.usage.forward_passes
