"""Hostile or careless model directories (the loading side): each gives a specific exception whose message
names the file and the field / tensor and value. Candidates that used to abort the process (allocation failure is
an abort, not a panic) also run in a subprocess, which must survive."""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mbd_rs
from conftest import run_child
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
    ("eos_outside_vocab", {"eos_token_id": [0, 320]}, ConfigError,
     ["config.json", "'eos_token_id'", "token id 320", "outside the vocabulary of 320 tokens"]),
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
    r = run_child(CHILD, d, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith(exc), r.stdout + r.stderr[-2000:]


def test_eos_outside_the_vocabulary_is_refused_where_it_is_named(model_copy):
    """An end-of-sequence id no token has would never end a sequence: generation_config.json's and the load override's
    are refused too (config.json's: CONFIG_CASES; a GGUF file's: test_gguf.py)."""
    d = model_copy()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 4000]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: field 'eos_token_id': token id 4000 is outside "
                                          r"the vocabulary of 320 tokens"):
        mbd_rs.Engine.load(d)
    q = model_copy("qwen2_gqa_tied")
    with pytest.raises(mbd_rs.InvalidRequestError, match=r"eos_token_ids: token id 320 is outside the vocabulary of "
                                                         r"320 tokens"):
        mbd_rs.Engine.load(q, eos_token_ids=[0, 320])
    assert mbd_rs.Engine.load(q, eos_token_ids=[0, 319]).info.eos_token_ids == [0, 319]


# Files a model brings that are not regular files: a FIFO (opening it for reading blocks until a writer comes: the
# load hung) and a symlink to /dev/zero (read until memory ran out). Each runs in a child under an address-space
# limit and a timeout, and must be refused naming the file. (The safetensors files were already: `model_file`.)
SPECIAL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"]

@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
@pytest.mark.parametrize("name", SPECIAL_FILES)
def test_fifos_and_devices_are_refused(model_copy, kind, name):
    d = model_copy("qwen2_gqa_tied")
    p = d / name
    if p.exists():
        p.unlink()
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no os.mkfifo here")
        os.mkfifo(p)
    else:
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        os.symlink("/dev/zero", p)
    try:
        r = run_child(CHILD, d, limit_mb=3072, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the load of a directory whose {name} is a {kind} hung")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("ModelLoadError"), r.stdout + r.stderr[-2000:]
    assert f"{name}: " in r.stdout and "regular file" in r.stdout, r.stdout


def test_json_files_are_bounded_in_size(model_copy):
    d = model_copy()
    with open(d / "generation_config.json", "wb") as f:  # 65 MiB: sparse, nothing on disk
        f.write(b"{")
        f.truncate(65 << 20)
    with pytest.raises(ModelLoadError, match=r"generation_config.json: 68157440 bytes is larger than the 64 MiB"):
        mbd_rs.Engine.load(d)
