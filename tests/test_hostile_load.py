"""Hostile or careless model directories (issue #11, loading side): each gives a specific exception whose message
names the file and the field / tensor and value. Candidates that used to abort the process (allocation failure is
an abort, not a panic) also run in a subprocess, which must survive."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mbd_rs
from mbd_rs import ConfigError, ModelFileNotFoundError, ModelLoadError, UnsupportedArchitectureError

# qwen3_headdim_gqa: Qwen3, 2 layers, hidden 64, 4 heads / 1 kv head, head_dim 32, vocab 320, untied.

CONFIG_CASES = [
    ("zero_layers", {"num_hidden_layers": 0}, ConfigError, ["config.json", "'num_hidden_layers'", "found 0"]),
    ("absurd_layers", {"num_hidden_layers": 10**9}, ConfigError, ["num_hidden_layers is 1000000000", "stores 2 layers"]),
    ("fewer_layers", {"num_hidden_layers": 1}, ConfigError, ["num_hidden_layers is 1", "stores 2 layers"]),
    ("absurd_vocab", {"vocab_size": 10**12}, ConfigError, ["vocab_size", "1000000000000", "model.embed_tokens.weight"]),
    ("overflowing_sizes", {"intermediate_size": 2**62}, ConfigError, ["intermediate_size (4611686018427387904)", "overflows"]),
    ("head_dim_mismatch", {"head_dim": 16}, ConfigError, ["num_attention_heads x head_dim", "q_proj"]),
    ("kv_heads_not_divisor", {"num_key_value_heads": 3}, ConfigError, ["num_key_value_heads (3)"]),
    ("eps_zero", {"rms_norm_eps": 0}, ConfigError, ["config.json", "'rms_norm_eps'", "found 0"]),
    ("eps_negative", {"rms_norm_eps": -1e-6}, ConfigError, ["'rms_norm_eps'", "-0.000001"]),
    ("eps_f32_underflow", {"rms_norm_eps": 1e-50}, ConfigError, ["'rms_norm_eps'", "f32"]),
    ("theta_zero", {"rope_theta": 0}, ConfigError, ["'rope_theta'", "found 0"]),
    ("theta_negative", {"rope_theta": -10000.0}, ConfigError, ["'rope_theta'", "-10000"]),
    ("theta_in_rope_parameters", {"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, ConfigError,
     ["rope_parameters", "'rope_theta'"]),
    ("rope_scaling_string", {"rope_scaling": "linear"}, ConfigError, ["'rope_scaling' must be an object", "a string"]),
    ("rope_scaling_no_type", {"rope_scaling": {"factor": 4.0}}, ConfigError, ["'rope_scaling'", "no 'rope_type'"]),
    ("rope_scaling_type_not_string", {"rope_scaling": {"rope_type": 2}}, ConfigError, ["'rope_type' must be a string"]),
    ("rope_scaling_unimplemented", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, UnsupportedArchitectureError,
     ["rope_scaling", "dynamic", "transformers applies"]),
    ("max_positions_absurd", {"max_position_embeddings": 10**15}, ConfigError, ["'max_position_embeddings'", "1000000000000000"]),
    ("max_positions_zero", {"max_position_embeddings": 0}, ConfigError, ["'max_position_embeddings'", "found 0"]),
    ("mask_id_beyond_32_bits", {"mask_token_id": 2**32 + 3}, ConfigError, ["'mask_token_id'", "4294967299", "32 bits"]),
    ("eos_id_beyond_32_bits", {"eos_token_id": [0, 2**40]}, ConfigError, ["'eos_token_id'", "1099511627776"]),
    ("block_size_zero", {"block_size": 0}, ConfigError, ["'block_size'", "found 0"]),
    ("block_size_absurd", {"block_size": 2**40}, ConfigError, ["block_size 1099511627776", "max_position_embeddings 256"]),
]


@pytest.mark.parametrize("name,edit,exc,needles", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config(model_copy, name, edit, exc, needles):
    d = model_copy(edit_config=lambda c: c.update(edit))
    with pytest.raises(exc) as ei:
        mbd_rs.Engine.load(d, device="cpu")
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


def _header(p):
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(p, header, body):
    raw = json.dumps(header).encode()
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def _edit_header(d, fn):
    p = d / "model.safetensors"
    h, body = _header(p)
    fn(h)
    _write(p, h, body)


def test_text_file_is_not_a_safetensors_file_and_not_echoed(model_copy):
    d = model_copy()
    (d / "model.safetensors").write_text("root:x:0:0:root:/root:/bin/bash\n" * 50)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: not a safetensors file") as ei:
        mbd_rs.Engine.load(d)
    said = str(ei.value).split("model.safetensors:", 1)[1]  # after the path (which may contain "root")
    assert "root" not in said and "bash" not in said, said


def test_nan_weight_refused_at_load(model_copy):
    d = model_copy()
    p = str(d / "model.safetensors")
    t = load_file(p)
    t["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(t, p)
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite value \(NaN\)"):
        mbd_rs.Engine.load(d)


def test_overlapping_tensors_refused(model_copy):
    d = model_copy()
    _edit_header(d, lambda h: h.__setitem__("alias", dict(h["model.norm.weight"])))
    with pytest.raises(ModelLoadError, match=r"overlap"):
        mbd_rs.Engine.load(d)


def test_unknown_dtype_refused(model_copy):
    d = model_copy()
    _edit_header(d, lambda h: h["model.norm.weight"].__setitem__("dtype", "Q4_K"))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: .*header entry 'model.norm.weight'"):
        mbd_rs.Engine.load(d)


def _shard(d):
    """Split model.safetensors into two shards and an index; returns the weight map."""
    t = load_file(str(d / "model.safetensors"))
    os.remove(d / "model.safetensors")
    parts, wm = ({}, {}), {}
    for k, v in t.items():
        i = 1 if ".layers.1." in k else 0
        parts[i][k] = v
        wm[k] = f"model-0000{i + 1}-of-00002.safetensors"
    for i in range(2):
        save_file(parts[i], str(d / f"model-0000{i + 1}-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return wm


def test_sharded_loads(model_copy):
    d = model_copy()
    _shard(d)
    mbd_rs.Engine.load(d).logits([1, 2, 3])


def test_empty_weight_map(model_copy):
    d = model_copy()
    _shard(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json: field 'weight_map' is empty"):
        mbd_rs.Engine.load(d)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_shard_outside_model_dir_refused(model_copy, tmp_path, how):
    d = model_copy()
    wm = _shard(d)
    outside = tmp_path / "outside.safetensors"
    os.rename(d / "model-00002-of-00002.safetensors", outside)
    if how == "absolute":
        name = str(outside)
    elif how == "dotdot":
        name = "../outside.safetensors"
    else:
        name = "link.safetensors"
        os.symlink(outside, d / name)
    wm = {k: (name if v.startswith("model-00002") else v) for k, v in wm.items()}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ModelLoadError, match=r"model.safetensors.index.json: weight_map names shard") as ei:
        mbd_rs.Engine.load(d)
    assert "inside the model directory" in str(ei.value) or "outside the model directory" in str(ei.value)


def test_missing_shard_is_named(model_copy):
    d = model_copy()
    _shard(d)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelFileNotFoundError, match=r"model-00002-of-00002.safetensors"):
        mbd_rs.Engine.load(d)


# Inputs that aborted the whole process before (allocation failure): run in a child, which must survive and
# report the right exception.
ABORT_CANDIDATES = {
    "layers_1e9": ("config", {"num_hidden_layers": 10**9}, "ConfigError"),
    "vocab_2e60": ("config", {"vocab_size": 2**60}, "ConfigError"),
    "terabyte_tensor": ("header", {"big": {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}, "ModelLoadError"),
    "numel_overflow": ("header", {"wrap": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}}, "ModelLoadError"),
    "bytes_overflow": ("header", {"wrap": {"dtype": "F32", "shape": [2**59], "data_offsets": [0, 0]}}, "ModelLoadError"),
}

CHILD = """
import sys, mbd_rs
try:
    mbd_rs.Engine.load(sys.argv[1], device="cpu")
    print("LOADED")
except mbd_rs.MbdError as e:
    print(type(e).__name__, str(e)[:300])
"""


@pytest.mark.parametrize("case", list(ABORT_CANDIDATES))
def test_former_abort_candidates_survive_in_a_subprocess(model_copy, case):
    where, edit, exc = ABORT_CANDIDATES[case]
    d = model_copy(edit_config=(lambda c: c.update(edit)) if where == "config" else None)
    if where == "header":
        _edit_header(d, lambda h: h.update(edit))
    r = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith(exc), r.stdout + r.stderr[-2000:]
