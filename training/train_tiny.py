"""Train mbd-tiny: a ~2.6M-parameter Qwen3-architecture block-diffusion model (SDAR-style: block-causal
attention aligned at absolute position 0, unshifted logits, a dedicated mask token) on the task families in
training/tasks.py. Writes a genuine HF Qwen3 checkpoint (transformers' Qwen3ForCausalLM loads it cleanly)
into python/mbd_rs/models/mbd-tiny/.

Developer tool (not a runtime dependency). Install, then run from the repository root:
    python3 -m venv /tmp/devenv && /tmp/devenv/bin/pip install torch transformers tokenizers safetensors numpy
    /tmp/devenv/bin/python training/train_tiny.py --steps 3200
Seeded; about 40 minutes on a 2-core CPU. (The shipped model was trained by this script with --steps 3200 and
then converted with --export-only, the step that now runs at the end of training.)

Training objective (block diffusion, as SDAR / D2F): the sequence is prompt ++ answer ++ <|im_end|> ++ padding
(<|endoftext|>). A block size B is drawn per batch from {1, 2, 4, 8} (B=1 is autoregressive), each answer block k
gets a mask ratio t_k ~ U(0, 1] (sorted ascending along the sequence in half of the batches, as in D2F's
progressive noise), answer positions are replaced by the mask token with probability t_k, and the model is trained
with cross-entropy on masked positions under block-causal attention (query p sees key q iff q//B <= p//B).
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import CHAT_TEMPLATE, render, sample  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SEQ = 80
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "mbd_rs", "models", "mbd-tiny")


def make_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    return tok


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def make_batch(tok, r, bsz, mask_id, eos_id, pad_id):
    b = r.choice([1, 2, 4, 4, 8])
    ids = torch.full((bsz, SEQ), pad_id, dtype=torch.long)
    noisy = ids.clone()
    target_mask = torch.zeros((bsz, SEQ), dtype=torch.bool)
    for i in range(bsz):
        _, p, a = sample(r, held_out=False)
        pr = encode(tok, render(p))
        an = encode(tok, a) + [eos_id]
        seq = (pr + an)[:SEQ]
        ids[i, : len(seq)] = torch.tensor(seq)
        lp = len(pr)
        nblocks = (SEQ - 1) // b + 1
        t = [r.uniform(1e-3, 1.0) for _ in range(nblocks)]
        if r.random() < 0.5:
            t.sort()
        for pos in range(lp, SEQ):
            if r.random() < t[pos // b]:
                target_mask[i, pos] = True
        noisy[i] = ids[i]
        noisy[i][target_mask[i]] = mask_id
    blk = torch.arange(SEQ) // b
    attn = torch.where(blk[None, :] <= blk[:, None], 0.0, float("-inf"))[None, None]
    return noisy, ids, target_mask, attn


def export_bf16(out):
    """Store the weights in bfloat16 (half the size in the package; the engine computes in f32 on CPU)."""
    m = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    m.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    print("exported bf16 weights to", out, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--export-only", action="store_true", help="only convert an existing f32 checkpoint to bf16")
    args = ap.parse_args()
    if args.export_only:
        export_bf16(args.out)
        return
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    r = random.Random(0)
    tok = make_tokenizer()
    pad_id, im_start, eos_id, mask_id = (tok.token_to_id(t) for t in SPECIALS)
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=192, intermediate_size=576, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                      bos_token_id=pad_id)
    model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    model.train()
    t0 = time.time()
    ema = None
    for step in range(args.steps):
        noisy, ids, tm, attn = make_batch(tok, r, args.batch, mask_id, eos_id, pad_id)
        logits = model(noisy, attention_mask=attn).logits
        loss = torch.nn.functional.cross_entropy(logits[tm], ids[tm])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d} loss {ema:.4f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:7.1f}s", flush=True)
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.config.block_size = 4
    model.config.mask_token_id = mask_id
    model.config.mbd_family = "mbd-tiny"
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mask|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 256},
              open(os.path.join(args.out, "tokenizer_config.json"), "w"), indent=1)
    gc = json.load(open(os.path.join(args.out, "generation_config.json")))
    gc["eos_token_id"] = [eos_id, pad_id]
    json.dump(gc, open(os.path.join(args.out, "generation_config.json"), "w"), indent=1)
    json.dump({"steps": args.steps, "batch": args.batch, "lr": args.lr, "final_loss_ema": ema,
               "train_seconds": time.time() - t0, "parameters": n_params},
              open(os.path.join(args.out, "training_log.json"), "w"), indent=1)
    print("saved", args.out, flush=True)
    export_bf16(args.out)


if __name__ == "__main__":
    main()
