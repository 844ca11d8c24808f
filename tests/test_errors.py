"""Bad input gets a specific exception naming the file / field / tensor / parameter — never a crash."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mbd_rs
from mbd_rs import (ConfigError, InvalidRequestError, MbdError, ModelFileNotFoundError, ModelLoadError,
                    UnsupportedArchitectureError)
from conftest import parity_dir


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFileNotFoundError) as ei:
        mbd_rs.Engine.load(tmp_path / "nope")
    assert isinstance(ei.value, FileNotFoundError) and "nope" in str(ei.value)


@pytest.mark.parametrize("fname", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(model_copy, fname):
    d = model_copy()
    os.remove(d / fname)
    with pytest.raises(FileNotFoundError) as ei:
        mbd_rs.Engine.load(d)
    assert fname in str(ei.value) or fname in (ei.value.filename or "")
    assert isinstance(ei.value, MbdError)


def test_malformed_json(model_copy):
    d = model_copy()
    (d / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ConfigError, match=r"config.json: malformed JSON"):
        mbd_rs.Engine.load(d)


def test_missing_field(model_copy):
    d = model_copy(edit_config=lambda c: c.pop("hidden_size"))
    with pytest.raises(ConfigError, match=r"config.json: field 'hidden_size' is missing"):
        mbd_rs.Engine.load(d)


def test_field_of_wrong_type(model_copy):
    d = model_copy(edit_config=lambda c: c.update(num_hidden_layers="two"))
    with pytest.raises(ConfigError, match=r"field 'num_hidden_layers' must be a non-negative integer, found a string"):
        mbd_rs.Engine.load(d)


def test_unsupported_architecture_lists_supported(model_copy):
    d = model_copy(edit_config=lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(UnsupportedArchitectureError) as ei:
        mbd_rs.Engine.load(d)
    msg = str(ei.value)
    assert "'LlamaForCausalLM'" in msg and "SDARForCausalLM" in msg and "DreamModel" in msg


def test_rope_scaling_refused(model_copy):
    d = model_copy(edit_config=lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    with pytest.raises(UnsupportedArchitectureError, match="rope_parameters.*not supported"):
        mbd_rs.Engine.load(d)


def _rewrite_weights(d, fn):
    p = str(d / "model.safetensors")
    t = load_file(p)
    fn(t)
    save_file(t, p)


def test_missing_tensor_is_named(model_copy):
    d = model_copy()
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.1.self_attn.k_norm.weight' is missing"):
        mbd_rs.Engine.load(d)


def test_wrong_shape_names_expected_and_found(model_copy):
    d = model_copy()
    _rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", np.zeros((96, 32), np.float32)))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[96, 32\], expected \[96, 64\]"):
        mbd_rs.Engine.load(d)


def test_truncated_safetensors(model_copy):
    d = model_copy()
    p = d / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: not a readable safetensors file"):
        mbd_rs.Engine.load(d)


def test_integer_weight_dtype_is_refused(model_copy):
    d = model_copy()
    _rewrite_weights(d, lambda t: t.__setitem__("model.norm.weight", np.ones((64,), np.int32)))
    with pytest.raises(ModelLoadError, match=r"tensor 'model.norm.weight' has dtype I32; supported weight dtypes"):
        mbd_rs.Engine.load(d)


def test_header_offsets_past_the_data_are_refused(model_copy):
    """A header that claims more bytes than the file holds is caught before any read, naming the tensor."""
    d = model_copy()
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = "model.layers.0.mlp.down_proj.weight"
    s, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [s, e + 4]  # one element too many for its shape
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data[8 + n:]))
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' .* has byte range"):
        mbd_rs.Engine.load(d)


def test_token_ids_out_of_range():
    eng = mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), device="cpu")
    with pytest.raises(InvalidRequestError, match=r"token id 320 at index 2 is out of range.*320 tokens"):
        eng.logits([1, 2, 320])
    with pytest.raises(InvalidRequestError, match=r"token id -1 at index 1"):
        eng.logits([1, -1])
    with pytest.raises(InvalidRequestError, match="at least one token"):
        eng.logits([])
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.logits("hello")
    with pytest.raises(InvalidRequestError, match="attention must be"):
        eng.logits([1, 2], attention="sliding")


def test_bad_load_arguments():
    with pytest.raises(TypeError, match="valid profile overrides"):
        mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), mask_id=3)
    with pytest.raises(InvalidRequestError, match="block_size must be >= 1, got 0"):
        mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), block_size=0)
    with pytest.raises(InvalidRequestError, match="device must be"):
        mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), device="tpu")
    with pytest.raises(InvalidRequestError, match="not supported on the CPU"):
        mbd_rs.Engine.load(parity_dir("qwen2_gqa_tied"), device="cpu", dtype="bfloat16")


def test_mask_id_outside_vocab(model_copy):
    d = model_copy(edit_config=lambda c: c.update(architectures=["SDARForCausalLM"], model_type="sdar",
                                                 mask_token_id=151669, block_size=4))
    with pytest.raises(ConfigError, match="mask_token_id 151669 is outside the vocabulary of 320"):
        mbd_rs.Engine.load(d)


def test_user_files_untouched(model_copy):
    d = model_copy()
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    eng = mbd_rs.Engine.load(d)
    eng.logits([1, 2, 3], prefix_len=1)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before
