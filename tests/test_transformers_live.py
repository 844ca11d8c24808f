"""Direct comparison against HF transformers on a freshly built random model. Needs torch and
transformers (developer tools, not runtime dependencies); skipped where they are not installed."""
import numpy as np
import pytest

import mbd_rs
from conftest import parity_dir

torch = pytest.importorskip("torch", reason="torch not installed: live transformers parity skipped (fixtures cover CI)")
transformers = pytest.importorskip("transformers", reason="transformers not installed: live parity skipped")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_live_block_causal_parity(tmp_path, arch):
    import shutil

    cfg_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    extra = dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True) if arch == "qwen3_moe" else {}
    cfg = cfg_cls(vocab_size=320, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False, **extra)
    torch.manual_seed(1)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    shutil.copy(f"{parity_dir('qwen2_gqa_tied')}/tokenizer.json", tmp_path / "tokenizer.json")
    ids = torch.randint(0, 320, (1, 23))
    b = 5
    blk = torch.arange(23) // b
    mask = torch.where(blk[None, :] <= blk[:, None], 0.0, torch.finfo(torch.float32).min)[None, None]
    model = model_cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits[0].numpy()
    eng = mbd_rs.Engine.load(tmp_path, device="cpu")
    got = eng.logits(ids[0].tolist(), attention="block_causal", block_size=b)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4
