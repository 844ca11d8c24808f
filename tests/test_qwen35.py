"""Qwen3.5 hybrid models: Gated DeltaNet layers beside gated softmax attention. Logits through the
cache equal transformers' full forward (fixtures of scripts/make_parity_fixtures.py; the whole-sequence cases are
in test_parity.py, decoding in test_decode_parity.py and test_isd.py); batched streams equal lone ones; the VL
checkpoint layout loads the same language model; what a recurrent state cannot do gets clear errors; hostile
configs get specific ones."""
import json
import os

import numpy as np
import pytest

import mbd_rs
from conftest import copy_model, load_cases, parity_dir
from test_batching import _requests, batched_equals_alone

HYBRIDS = ["qwen35_hybrid", "qwen35_mixed_tied", "qwen35moe_top2_shared"]
CASES = load_cases()["cases"]


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("case,prefixes", [
    ("causal", [1, 2, 5, 11, 18]),
    ("block4_absolute", [4, 8, 12, 16]),
    ("block3_absolute", [3, 9, 15, 18]),
    ("block4_prompt6", [6, 10, 14]),
])
def test_cached_prefix_then_window_equals_transformers(name, case, prefixes):
    """prefix_len tokens go through the cache in block-aligned chunks (each commit advances the recurrent states
    over exactly its rows), the rest is one window from those states: transformers' logits over the whole
    sequence, for windows of every size."""
    eng = mbd_rs.Engine.load(parity_dir(name), device="cpu")
    exp = np.load(os.path.join(parity_dir(name), "expected.npz"))
    c = CASES[case]
    kw = dict(attention=c["attention"], block_size=c["block_size"], alignment=c["alignment"], prompt_len=c["prompt_len"])
    for prefix in prefixes:
        got = eng.logits(exp["ids"], prefix_len=prefix, **kw)
        assert rel_err(got, exp[case]) <= 1e-4, (name, case, prefix)


def test_the_recurrent_layers_carry_the_context():
    """Guard against a vacuous pass: the GDN state carries information from before the window (a changed first
    token changes the last row's logits through the cache), and the full-attention case differs from the
    block-causal one only through the softmax layers (the GDN layers stay causal)."""
    eng = mbd_rs.Engine.load(parity_dir("qwen35_hybrid"), device="cpu")
    exp = np.load(os.path.join(parity_dir("qwen35_hybrid"), "expected.npz"))
    ids = list(exp["ids"])
    other = [(ids[0] + 1) % 300] + ids[1:]
    a = eng.logits(ids, prefix_len=16, attention="causal")
    b = eng.logits(other, prefix_len=16, attention="causal")
    assert rel_err(a[-1], b[-1]) > 1e-3
    assert rel_err(exp["full"], exp["block4_absolute"]) > 1e-2


@pytest.fixture(scope="module")
def hybrid():
    return mbd_rs.Engine.load(parity_dir("qwen35_hybrid"), mask_token_id=3, attention="block_causal",
                              logits_shift=True, block_size=4)


def test_concurrent_streams_equal_streams_alone(hybrid):
    """Each stream's recurrent state is its own: batched forwards (windows of several streams, prefill chunks,
    shifted S2D2 verifications, sub-blocks, cache on and off) give the tokens each stream gives alone."""
    batched_equals_alone(hybrid, 10)


def test_cache_on_and_off_give_the_same_tokens_and_forwards(hybrid):
    for i, (prompt, kw) in enumerate(_requests(6, speculative=True)):
        kw = {k: v for k, v in kw.items() if k != "use_cache"}
        on = hybrid.generate(prompt, use_cache=True, **kw)
        off = hybrid.generate(prompt, use_cache=False, **kw)
        assert on.token_ids == off.token_ids and on.usage.forward_passes == off.usage.forward_passes, i


def test_moe_hybrid_decodes_alike_cached_uncached_and_batched():
    """Qwen3.5-MoE (routed experts and the shared one beside GDN layers): cache on and off, alone and batched, the
    same tokens and forwards."""
    eng = mbd_rs.Engine.load(parity_dir("qwen35moe_top2_shared"), mask_token_id=3, attention="block_causal",
                             logits_shift=True, block_size=4)
    for prompt, kw in _requests(4):
        kw = {k: v for k, v in kw.items() if k != "use_cache"}
        on, off = eng.generate(prompt, use_cache=True, **kw), eng.generate(prompt, use_cache=False, **kw)
        assert on.token_ids == off.token_ids and on.usage.forward_passes == off.usage.forward_passes
    batched_equals_alone(eng, 6)


def _vl_copy(src, dst):
    """The text checkpoint rewritten as Qwen3.5's VL layout: config under text_config, tensors under
    model.language_model.*, plus a vision tower and an MTP head that must be left unread."""
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f not in ("config.json", "model.safetensors", "expected.npz"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    text = json.load(open(os.path.join(src, "config.json")))
    top = {k: text.pop(k) for k in ["architectures", "tie_word_embeddings"] if k in text}
    top["architectures"] = [top["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")]
    cfg = dict(top, model_type=text["model_type"].replace("_text", ""), text_config=text,
               vision_config={"depth": 2, "hidden_size": 8})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    ws = load_file(os.path.join(src, "model.safetensors"))
    out = {(("model.language_model." + k[len("model."):]) if k.startswith("model.") else k): v for k, v in ws.items()}
    out["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((24, 8), np.float32)
    out["mtp.fc.weight"] = np.zeros((8, 8), np.float32)
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("name", HYBRIDS)
def test_vl_checkpoint_layout_loads_its_language_model(name, tmp_path):
    exp = np.load(os.path.join(parity_dir(name), "expected.npz"))
    eng = mbd_rs.Engine.load(_vl_copy(parity_dir(name), str(tmp_path / "vl")), device="cpu")
    assert eng.info.family in ("qwen3_5", "qwen3_5_moe") and eng.info.architecture.endswith("ForConditionalGeneration")
    got = eng.logits(exp["ids"], attention="block_causal", block_size=4)
    assert rel_err(got, exp["block4_absolute"]) <= 1e-4


def test_what_a_recurrent_state_cannot_do_is_refused():
    # full attention reaches only the softmax layers: the load says so
    with pytest.warns(UserWarning, match="attention='full' on a Qwen3.5 hybrid: only its softmax layers"):
        full = mbd_rs.Engine.load(parity_dir("qwen35_hybrid"), mask_token_id=3, attention="full", logits_shift=True)
    assert any("Gated DeltaNet layers stay causal" in w for w in full.info.warnings)
    for cache in ["prefix", "dual"]:
        with pytest.raises(mbd_rs.InvalidRequestError, match="Gated DeltaNet"):
            full.generate([5, 6, 7], max_tokens=4, cache=cache)
    # without a cache full attention runs (every step recomputes the canvas, the GDN layers causal)
    assert len(full.generate([5, 6, 7], max_tokens=4, early_stop=False).token_ids) == 4
    unshifted = mbd_rs.Engine.load(parity_dir("qwen35_hybrid"), mask_token_id=3, attention="block_causal",
                                   logits_shift=False, block_size=4)
    with pytest.raises(mbd_rs.InvalidRequestError, match="two rows per position"):
        unshifted.generate([5, 6, 7], max_tokens=4, speculative="s2d2")
    with pytest.raises(mbd_rs.InvalidRequestError, match="two rows per position"):
        unshifted.prompt_logprobs([5, 6, 7, 8])
    # shifted models score left to right as any causal LM
    shifted = mbd_rs.Engine.load(parity_dir("qwen35_hybrid"), mask_token_id=3)
    assert len(shifted.prompt_logprobs([5, 6, 7, 8])) == 4


@pytest.mark.parametrize("edit,error,match", [
    (lambda c: c.update(layer_types=["linear_attention"] * 3), mbd_rs.ConfigError,
     "layer_types' lists 3 layers but num_hidden_layers is 4"),
    (lambda c: c.update(layer_types=["full_attention"] * 4), mbd_rs.ConfigError,
     "layer 0 is 'full_attention'.*stores a 'linear_attention' layer"),
    (lambda c: c.update(layer_types=["linear_attention"] * 4), mbd_rs.ConfigError,
     "layer 3 is 'linear_attention'.*stores a 'full_attention' layer"),
    (lambda c: c.update(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]),
     mbd_rs.ConfigError, r"layer_types\[1\] must be 'full_attention' or 'linear_attention'"),
    (lambda c: c.update(linear_num_value_heads=3), mbd_rs.ConfigError,
     r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    (lambda c: c.update(linear_key_head_dim=1 << 20, linear_value_head_dim=1 << 20), mbd_rs.ConfigError,
     "Gated DeltaNet state .* is absurd"),
    (lambda c: c.update(linear_num_value_heads=1 << 62, linear_num_key_heads=2), mbd_rs.ConfigError,
     "absurd|overflows"),
    (lambda c: c.update(linear_conv_kernel_dim=0), mbd_rs.ConfigError, "linear_conv_kernel_dim' must be between 1"),
    (lambda c: c.update(linear_key_head_dim=8), mbd_rs.ConfigError, "does not match tensor .*in_proj_qkv"),
    (lambda c: c.update(attn_output_gate=False), mbd_rs.UnsupportedArchitectureError, "attn_output_gate=false"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.3), mbd_rs.ConfigError,
     "positive even number of rotary dims"),
    (lambda c: c.update(text_config=[1, 2]), mbd_rs.ConfigError, "'text_config' must be an object"),
    (lambda c: c.update(num_attention_heads=8), mbd_rs.ConfigError, "does not match tensor"),
])
def test_hostile_configs_get_specific_errors(tmp_path, edit, error, match):
    d = copy_model(parity_dir("qwen35_hybrid"), tmp_path / "m", edit)
    with pytest.raises(error, match=match):
        mbd_rs.Engine.load(str(d), device="cpu")
