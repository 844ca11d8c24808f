"""scripts/make_checkpoint.py makes what a user would point the engine at for each family: the
published architecture and decoding fields, the mask token at its real id in a real Qwen vocabulary (when
llama-cpp-python's sdist is at hand), sharded weights with an index, and a model that loads and decodes."""
import json
import os
import subprocess
import sys

import pytest

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "make_checkpoint.py")
pytestmark = [pytest.mark.source_tree, pytest.mark.skipif(not os.path.isfile(SCRIPT), reason="needs scripts/")]
SDIST = os.environ.get("MBD_LLAMACPP_SDIST", "")

# family -> (shape, architecture, real mask id, logits shift, attention, block size)
CASES = {
    "sdar": ("1.7b", "SDARForCausalLM", 151669, False, "block_causal", 4),
    "fast_dllm_v2": ("0.5b", "Fast_dLLM_QwenForCausalLM", 151665, True, "block_causal", 32),
    "dream": ("0.5b", "DreamModel", 151666, True, "full", 32),
    "qwen2": ("0.5b", "Qwen2ForCausalLM", None, True, "causal", 1),
}


@pytest.mark.slow  # a real vocabulary's embedding per family: 18-33 s each
@pytest.mark.parametrize("family", sorted(CASES))
def test_checkpoint_loads_as_its_family(tmp_path, family):
    shape, arch, mask, shift, attention, block = CASES[family]
    out = str(tmp_path / family)
    r = subprocess.run([sys.executable, SCRIPT, "--family", family, "--shape", shape, "--layers", "1",
                        "--shard-mb", "200", out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 2
    # a plain causal checkpoint has no mask token; decoding still takes one (any id: causal steps never forward it)
    eng = mbd_rs.Engine.load(out, **({"mask_token_id": 151643} if mask is None else {}))
    i = eng.info
    assert (i.architecture, i.logits_shift, i.attention) == (arch, shift, attention)
    assert i.num_layers == 1 and i.vocab_size == json.load(open(os.path.join(out, "config.json")))["vocab_size"]
    real_vocab = os.path.exists(SDIST)
    if mask is not None and real_vocab:
        assert i.mask_token_id == mask
        mask_text = eng.detokenize([mask], skip_special_tokens=False)
        assert eng.tokenize(mask_text, add_special_tokens=False) == [mask]
    if attention != "causal":
        assert i.block_size == block
    out2 = eng.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert out2.usage.completion_tokens >= 1
