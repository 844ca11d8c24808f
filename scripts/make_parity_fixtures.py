"""Build the small random Qwen2 / Qwen3 / Qwen3-MoE checkpoints used by the parity tests and record
HF transformers' logits for them under causal, block-causal (both gridings) and full attention masks.

Developer tool, not a runtime dependency. Install once (CPU is enough):
    python3 -m venv /tmp/devenv && /tmp/devenv/bin/pip install torch transformers safetensors tokenizers numpy
Run from the repository root:
    /tmp/devenv/bin/python scripts/make_parity_fixtures.py [--only NAME]

Writes tests/fixtures/parity/<name>/ (a real HF model directory: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) and tests/fixtures/parity/<name>/expected.npz
(`ids` and one logits array per case), plus tests/fixtures/parity/cases.json describing the cases.
The masks here are written from the definition "query p sees key q iff blk(q) <= blk(p)", independently of
the Rust code.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference.decoder import block_of  # noqa: E402  (the mask definition, shared with the reference decoder)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "parity")
SEQ_LEN = 19
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
VOCAB = 320

CORPUS = [
    "Block diffusion language models decode several tokens per forward pass.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }",
    "sort 3 1 2 -> 1 2 3; reverse a b c -> c b a; add 12 + 30 = 42",
    "Once upon a time there was a tiny model that learned to count: one two three four five.",
]


def make_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


# name -> (config class, model class, config kwargs)
FIXTURES = {
    # Qwen2: q/k/v bias always; GQA 4:2; tied embeddings.
    "qwen2_gqa_tied": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen2: plain multi-head attention, untied head.
    "qwen2_mha_untied": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    # Qwen3: head_dim (32) != hidden/heads (16), GQA 4:1, q/k norm, untied.
    "qwen3_headdim_gqa": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
    # Qwen3 with attention_bias=true and tied embeddings.
    "qwen3_bias_tied": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True)),
    # Qwen3-MoE top-1 routing (no renormalisation needed).
    "qwen3moe_top1": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, norm_topk_prob=False, tie_word_embeddings=False)),
    # Qwen3-MoE top-2 with renormalised top-k and a dense layer (mlp_only_layers).
    "qwen3moe_top2_norm": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    # Qwen3-MoE top-2 whose routers are well separated at every position (router weights scaled up, and the seed
    # checked): the fixture that a bfloat16 run (the GPU's) can be held to a bound on. In the two above some
    # positions' k-th and (k+1)-th experts are within ~1e-3 in probability, below what bf16 hidden states resolve.
    "qwen3moe_top2_separated": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=False)),
    # Qwen3.5 hybrid: three Gated DeltaNet layers then gated attention (the default interval), value heads grouped
    # over key heads (4 over 2), partial RoPE (8 of 32 dims), untied.
    "qwen35_hybrid": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)),
    # Qwen3.5 with explicit layer_types (attention first and last), as many value as key heads, dk != dv, a 3-tap
    # convolution, half the head dims rotated, MHA, tied embeddings.
    "qwen35_mixed_tied": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, tie_word_embeddings=True)),
    # Qwen3.5-MoE: the hybrid's layers with every MLP routed (top-2 of 6, renormalised) plus a gated shared expert.
    "qwen35moe_top2_shared": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32, tie_word_embeddings=False)),
}

# Hybrid models: the block-diffusion mask goes to the softmax layers only (the Gated DeltaNet layers stay causal, as
# the multi-block reference decoder runs transformers' Qwen3.5 with a 4-D mask).
HYBRID = {"qwen35_hybrid", "qwen35_mixed_tied", "qwen35moe_top2_shared"}

# name -> (factor on the router weights, smallest gap between the k-th and (k+1)-th router logit allowed: bf16
# hidden states move router logits of this size by ~0.03)
SEPARATED_ROUTERS = {"qwen3moe_top2_separated": (4.0, 0.25)}


def router_gap(model, ids):
    """The smallest gap between the k-th and (k+1)-th router logit over every MoE layer and position."""
    k = model.config.num_experts_per_tok
    gaps = []

    def hook(mod, inp, out):
        logits = (out[0] if isinstance(out, tuple) else out).float().sort(dim=-1, descending=True).values
        gaps.append(float((logits[..., k - 1] - logits[..., k]).min()))

    hs = [m.mlp.gate.register_forward_hook(hook) for m in model.model.layers if hasattr(m.mlp, "gate")]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    return min(gaps)

# case name -> (attention, block_size, alignment, prompt_len)
CASES = {
    "causal": ("causal", 1, "absolute", 0),
    "block4_absolute": ("block_causal", 4, "absolute", 0),
    "block3_absolute": ("block_causal", 3, "absolute", 0),
    "block4_prompt6": ("block_causal", 4, "prompt", 6),
    "block5_prompt3": ("block_causal", 5, "prompt", 3),
    "full": ("full", 1, "absolute", 0),
}


def mask_4d(n, case):
    attention, b, alignment, lp = case
    blk = [block_of(p, attention, b, alignment, lp) for p in range(n)]
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    for i in range(n):
        for j in range(n):
            if blk[j] <= blk[i]:
                m[i, j] = 0.0
    return m[None, None]


def scale_weights(model, gen):
    # Random weights scaled so that logits are well separated (std of a few units, not ~0.01).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
            elif "norm" in name:
                # Qwen3.5's RMSNorms store w - 1 (zero at init; its gated norm stores w)
                centre = 0.0 if isinstance(model, (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)) and "linear_attn.norm" not in name else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                # decay rates exp(A_log) softplus(a + dt_bias) of ~0.1-0.5 per token: the state carries over a window
                p.copy_(-1.5 + 0.5 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        model.get_output_embeddings().weight.mul_(3.0) if not model.config.tie_word_embeddings else None


def write_dir(path, model, tok, dtype=None):
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def main():
    # `--only NAME`: (re)write that fixture alone and its entry in cases.json, leaving the others' files as they are
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    if only is not None and only not in FIXTURES:
        sys.exit(f"unknown fixture {only} (known: {', '.join(FIXTURES)})")
    torch.manual_seed(0)
    tok = make_tokenizer()
    mask_id = tok.token_to_id("<|mask|>")
    eos_id = tok.token_to_id("<|endoftext|>")
    os.makedirs(ROOT, exist_ok=True)
    report = {}
    if only is not None:
        with open(os.path.join(ROOT, "cases.json")) as f:
            report = json.load(f)["report"]
    for i, (name, (cfg_cls, model_cls, kw)) in enumerate(FIXTURES.items()):
        if only is not None and name != only:
            continue
        base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                    eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id, attn_implementation="eager")
        if "rope_parameters" in kw:
            del base["rope_theta"]
        cfg = cfg_cls(**{**base, **kw})
        for attempt in range(100):
            gen = torch.Generator().manual_seed(100 + i + 1000 * attempt)
            model = model_cls(cfg).eval()
            scale_weights(model, gen)
            ids = torch.randint(0, tok.get_vocab_size(), (1, SEQ_LEN), generator=gen)
            if name not in SEPARATED_ROUTERS:
                break
            factor, min_gap = SEPARATED_ROUTERS[name]
            with torch.no_grad():
                for layer in model.model.layers:
                    if hasattr(layer.mlp, "gate"):
                        layer.mlp.gate.weight.mul_(factor)
            if router_gap(model, ids) >= min_gap:
                break
        else:
            sys.exit(f"{name}: no seed in 100 gives routers separated by {SEPARATED_ROUTERS[name][1]}")
        path = os.path.join(ROOT, name)
        write_dir(path, model, tok)
        # Reload from disk so the reference is exactly what the checkpoint holds.
        model = model_cls.from_pretrained(path, attn_implementation="eager").eval()
        out = {"ids": ids[0].numpy().astype(np.int64)}
        with torch.no_grad():
            plain = model(ids).logits[0].float()
            for cname, case in CASES.items():
                mask = mask_4d(SEQ_LEN, case)
                if name in HYBRID:
                    mask = {"full_attention": mask, "linear_attention": None}
                lg = model(ids, attention_mask=mask).logits[0].float()
                out[cname] = lg.numpy().astype(np.float32)
            # Sanity: the explicit causal mask reproduces transformers' own causal path.
            assert torch.allclose(plain, torch.from_numpy(out["causal"]), atol=1e-5), name
        np.savez(os.path.join(path, "expected.npz"), **out)
        top2 = np.sort(out["causal"], axis=-1)[:, -2:]
        report[name] = dict(logit_std=float(out["causal"].std()), min_top_gap=float((top2[:, 1] - top2[:, 0]).min()),
                            params=sum(p.numel() for p in model.parameters()))
        if name in SEPARATED_ROUTERS:
            report[name]["min_router_gap"] = router_gap(model, ids)
        print(name, report[name])
    if only is not None:
        write_cases(mask_id, eos_id, report)
        return
    # A bf16 checkpoint and its exact f32 twin (the same bf16-rounded weights stored as f32).
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=eos_id,
                      tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(999)
    model = Qwen3ForCausalLM(cfg).eval()
    scale_weights(model, gen)
    model = model.to(torch.bfloat16)
    write_dir(os.path.join(ROOT, "qwen3_bf16"), model, tok)
    write_dir(os.path.join(ROOT, "qwen3_bf16_f32twin"), model.to(torch.float32), tok)
    write_cases(mask_id, eos_id, report)


def write_cases(mask_id, eos_id, report):
    with open(os.path.join(ROOT, "cases.json"), "w") as f:
        json.dump({"cases": {k: dict(zip(["attention", "block_size", "alignment", "prompt_len"], v)) for k, v in CASES.items()},
                   "fixtures": list(FIXTURES), "mask_token_id": mask_id, "eos_token_id": eos_id, "report": report}, f, indent=1)
    print("wrote", ROOT, file=sys.stderr)


if __name__ == "__main__":
    main()
