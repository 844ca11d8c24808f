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


def test_live_greedy_controls_equal_transformers_generate(tmp_path):
    """Greedy AR under repetition_penalty, logit_bias and OpenAI's presence/frequency penalties equals transformers'
    generate with RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor and a processor written from
    OpenAI's definition (transformers has none for it), token for token."""
    import shutil

    from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                        RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor)

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, prompt_len, presence, frequency):
            self.lp, self.presence, self.frequency = prompt_len, presence, frequency

        def __call__(self, input_ids, scores):
            gen = input_ids[:, self.lp:]
            counts = torch.zeros_like(scores).scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    shutil.copy(f"{parity_dir('qwen2_gqa_tied')}/tokenizer.json", tmp_path / "tokenizer.json")
    eng = mbd_rs.Engine.load(tmp_path, device="cpu", mask_token_id=3, attention="causal", logits_shift=True,
                             eos_token_ids=[0])
    prompt = [17, 45, 210, 17, 9]
    n = 24
    cases = [dict(repetition_penalty=1.5), dict(repetition_penalty=0.7), dict(presence_penalty=1.5),
             dict(frequency_penalty=0.9), dict(logit_bias={"42": 8.0, "17": -100.0}),
             dict(repetition_penalty=1.2, presence_penalty=-0.4, frequency_penalty=0.5, logit_bias={"7": 4.0})]
    changed = 0
    plain = eng.generate(prompt, max_tokens=n).token_ids
    for kw in cases:
        procs = []
        if "logit_bias" in kw:
            procs.append(SequenceBiasLogitsProcessor({(int(t),): b for t, b in kw["logit_bias"].items()}))
        if "repetition_penalty" in kw:
            procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
        if "presence_penalty" in kw or "frequency_penalty" in kw:
            procs.append(OpenAIPenalties(len(prompt), kw.get("presence_penalty", 0.0),
                                         kw.get("frequency_penalty", 0.0)))
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=0,
                                 pad_token_id=0, logits_processor=LogitsProcessorList(procs))[0, len(prompt):]
        want = [int(t) for t in out]
        if 0 in want:
            want = want[:want.index(0)]
        got = eng.generate(prompt, max_tokens=n, **kw).token_ids
        assert got == want, kw
        changed += got != plain
    assert changed >= 4
