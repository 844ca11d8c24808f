"""Train the small block-diffusion checkpoints of mbd-rs, one per supported family, on the task families of
training/tasks.py (same generator, same held-out split: a prompt is held out iff the sum of its character codes
is a multiple of 7). One seeded script; the device is picked automatically (CUDA when available).

    --family tiny          mbd-tiny v3, the embedded default (python/mbd_rs/models/mbd-tiny; v1 and v2 are its
                           earlier versions, training/README.md). SDAR layout exactly as v1: Qwen3 weights,
                           `"mbd_family": "mbd-tiny"`, block-causal attention aligned at absolute position 0,
                           UNSHIFTED logits (position i predicts token i), `mask_token_id` and `block_size` in
                           config.json, v1's tokenizer (ids 0..3 = <|endoftext|> <|im_start|> <|im_end|> <|mask|>)
                           and chat template.
    --family dream         Dream-style twin: Qwen2 weights (q/k/v bias, untied head), config.json with
                           `architectures ["DreamModel"]`, `model_type "Dream"`, `mask_token_id` (as Dream's config
                           has; our loader reads the Dream mask id from config.json only), FULL bidirectional
                           attention, SHIFTED logits (position i predicts token i+1). Mask token `<|mask|>` is the
                           LAST vocabulary entry (id 99), as Dream's 151666 sits after the Qwen specials.
    --family qwen35        Qwen3.5 hybrid twin: Qwen3_5ForCausalLM weights, every other layer Gated DeltaNet
                           (causal), every 2nd gated softmax attention (block-causal), config.json with
                           `block_size`, `mask_token_id` and `logits_shift: false` (a block-diffusion conversion as
                           arcLM's), v1's tokenizer. Objective d2f only, one sample per row (a recurrence would carry
                           state across packed samples). On a CPU transformers' GDN runs its torch fallback: the
                           twin is sized for that (3.33M parameters, ~0.9 s a step of 48 on 2 cores; see its card for
                           the two stages of models/mbd-qwen35-tiny). training/gpu_run.sh FAMILIES=qwen35 on a GPU.
    --family fast_dllm_v2  Fast-dLLM-v2-style twin: Qwen2 weights (untied head), `architectures
                           ["Fast_dLLM_QwenForCausalLM"]`, `model_type "Fast_dLLM_Qwen"`, `bd_size`,
                           `conplemenrary_mask: true` (sic, as the real config), NO mask_token_id in config.json:
                           the mask is the tokenizer token `|<MASK>|` (id 99, last), found by name as the real
                           checkpoint's 151665. Block-causal aligned at 0, SHIFTED logits. eos = pad = <|im_end|>.
    --family idlm          I-DLM-style twin: Qwen3 weights (untied head, as I-DLM-8B), config.json as
                           I-DLM's (`architectures ["SDARForCausalLM"]`, `model_type "sdar"`, `block_size` 3,
                           `mask_token_id`), STRICTLY CAUSAL, SHIFTED logits; mask `<|mask|>` last (id 99). Objective
                           idlm only. Nothing in the config says causal + shifted (as in the real one): the engine loads
                           it with `attention="causal", logits_shift=True` and decodes it with `speculative="isd"`.
    --family tools         mbd-tools-tiny: the tiny family's layout, tokenizer and specials with a 512-token context
                           and training/tool_tasks.py's TOOLS_TEMPLATE (a compact tool list, Hermes' <tool_call>);
                           warm-started from mbd-tiny (--init). Its samples are drawn by kind (tool_mix: call,
                           result, plain = an old task with the tools listed, bare = without); lr 1e-3. Its tool
                           results come from the engine: training/eval_tools.py DIR writes DIR/tool_eval.json, then
                           --recard DIR --eval-per-task 0 puts them in the card. As trained (training/README.md):
        /tmp/devenv/bin/python training/train.py --family tools --init python/mbd_rs/models/mbd-tiny \
            --out /work/trained/mbd-tools-tiny --minutes 65 --steps 100000 --batch 32 --threads 1 --objectives d2f:1
        # then (2026-12-06) a stage weighted to copying the city (more calls, more made-up names, the city's
        # characters weighted 3 in the loss), bf16 autocast (about 2x the steps a minute on one CPU thread):
        /tmp/devenv/bin/python training/train.py --family tools --init models/mbd-tools-tiny \
            --out /work/trained/tools-v2 --minutes 93 --steps 100000 --batch 32 --threads 1 --objectives d2f:1 \
            --tool-mix call:0.4,result:0.3,plain:0.13,bare:0.17 --made-up 0.7 --city-weight 3 --bf16 --lr 1e-3

Every output directory is a genuine HF checkpoint: Qwen3ForCausalLM / Qwen2ForCausalLM load its
model.safetensors with no missing or unexpected keys (`--check DIR` verifies it). Weights are stored in bf16.

Objectives (all cross-entropy on masked answer positions; the prompt is never masked; the "answer" region is
answer ++ <|im_end|> ++ pad tokens up to a per-sample canvas end, so the model learns to stop):
  d2f   one noisy sequence under block-causal attention (query p sees key q iff q//B <= p//B); every answer block k
        gets its own mask ratio t_k ~ U(0.001, 1], sorted ascending along the sequence in half of the samples
        (D2F's progressive noise). Earlier blocks are noisy too, as in multi-block decoding. (v1's objective.)
  bd3   noisy ++ clean copy (2L positions, both with position ids 0..L-1): a noisy query in block b sees the noisy
        keys of block b and the clean keys of blocks < b; a clean query sees clean keys of blocks <= b
        (BD3-LM / SDAR / Fast-dLLM v2 training: blocks are denoised with a clean left context, as in
        single-block semi-AR decoding). Per-block ratios t_k ~ U(0.001, 1].
  bd3c  bd3 with complementary masks (Fast-dLLM v2): every sample appears twice in the batch, masked with m and with
        its complement (within the answer), so every answer token is supervised exactly once per pair.
  dream one noisy sequence under FULL attention, one ratio t ~ U(0.001, 1] per sample (stratified over the batch)
        over the whole answer region, loss weighted by 1/t and normalised by the number of answer tokens (the
        masked-diffusion ELBO that Dream and LLaDA train with; Dream's CART re-weighting is not used).
  dream_prog  FULL attention too, but the answer region is cut into blocks of B from the answer's start and block k
        gets its own ratio t_k ~ U(0.001, 1], sorted ascending (D2F's progressive noise: clean-ish left, masked
        right, the shape semi-AR and multi-block decoding of a full-attention model meet); plain mean cross-entropy
        over the masked tokens. Our addition for a small CPU budget (with `dream` alone a 1.6M-parameter twin had
        not learned to copy from the prompt after 95 minutes; with the mix it still had not after 75:
        benches/results/models-twins.md).
  idlm  I-DLM's training (arXiv 2604.11035; its repository's training/ code, read for the recipe): noisy ++ clean
        (2L positions, position ids 0..L-1 in both) where the noisy copy masks EVERY answer position ("all-masked");
        a noisy query sees the noisy keys of its own block at or before it (strictly causal inside the block) and the
        clean keys of earlier blocks; a clean query sees the clean keys at or before it (plain causal). Shifted: the
        noisy row of a masked position p predicts token p + 1 (a draft two or more tokens past the clean context, as
        ISD's mask rows), the clean rows predict the next answer token (AR, the verifier). Loss (CE_noisy + alpha *
        CE_clean) / answer tokens; I-DLM converts a trained AR model with alpha 0.2, the twin learns AR from scratch:
        alpha 1.0 (--ce-alpha). Blocks B = masks per noisy block (I-DLM's block_size b serves ISD stride b + 1).
With shifted logits (dream, fast_dllm_v2) the target at position p is read from the logit at p-1. In bd3/bd3c the
first position of a block is predicted from the CLEAN copy's last position of the previous block (at inference that
logit comes from the committed previous block, the "carry" row); the other positions from the noisy p-1.

Mixtures (per batch, seeded; block size B per batch):
  tiny          objective d2f 3/4, bd3 1/4;  B from {1:1, 2:1, 4:3, 8:2, 16:1} (B=1 is autoregressive); lr 2e-3
  dream         objective dream 1/2, dream_prog 1/2;  B from {1:1, 2:1, 4:2, 8:1} (dream_prog's blocks); lr 5e-4
  fast_dllm_v2  objective bd3c 1/2, d2f 1/2;  B from {1:1, 2:1, 4:2, 8:2}, config bd_size 8; lr 5e-4. The d2f half
                (noisy earlier blocks) and the blocks below 8 are our additions so that multi-block decoding and
                small blocks are in distribution; real Fast-dLLM v2 trains bd3c at bd_size only.
  idlm          objective idlm;  B from {1:1, 2:1, 3:2, 5:1, 7:1} (strides 2..8; config block_size 3: stride 4);
                lr 2e-3 (Qwen3's QK-norm, as tiny)
Tasks (weights): tiny sort 1, reverse 1, repeat 1, hello 1, add 2, count 1, shuffle 1.5 (v3; v2 had hello 0.5,
count 2 and no shuffle: add and count were the hard ones); the twins uniform over v1's six families (a copy-heavy
mix: copying from the prompt has to be learned first).
Why the twins differ from the tiny recipe (benches/results/models-twins.md, 2026-11-24): Qwen2 has no QK-norm, and
at lr 2e-3 the twins' attention collapsed early (mean head entropy 0.4-1.6 nats over a 36-token canvas, against
2-3.7 for v1 and for the twin at 5e-4) and they never learned to copy from the prompt; blocks of 1 and 2
(semi-autoregressive) make copying easy to find; and v1's depth and width (6 layers, MLP 576) instead of 5 and 384.
Canvas: prompt ++ answer ++ <|im_end|> ++ pad, cut at prompt + answer + 1 + U{0..16} tokens (the engine's canvas is
prompt + max_tokens, so the model sees canvases of varying length); for dream (full attention: every trailing
mask is seen) a quarter of the samples have an answer region U{answer + 1..48} positions long, as max_tokens up to
48 gives. Batches of --batch sequences (48 on CPU) are packed first-fit-decreasing into rows of 96 positions (128
for dream): position ids restart at 0 in every sequence (so block grids
stay aligned at each sequence's position 0) and attention never crosses sequences (no padding compute).
Optimiser: AdamW (0.9, 0.98), weight decay 0.01, grad-norm clip 1.0, linear warm-up 100 steps then cosine to 0
over --steps; seeds: torch 0, data random.Random(0) (+ --seed).

Commands (from the repository root; developer tool, not a runtime dependency):
    python3 -m venv /tmp/devenv && /tmp/devenv/bin/pip install torch transformers tokenizers safetensors numpy
    /tmp/devenv/bin/python training/train.py --family tiny --out /work/trained/mbd-tiny-v2 --steps 2000 --threads 1
    /tmp/devenv/bin/python training/train.py --family dream --out /work/trained/mbd-dream-tiny --steps 2000
    /tmp/devenv/bin/python training/train.py --family fast_dllm_v2 --out /work/trained/mbd-fdv2-tiny --steps 2000
    /tmp/devenv/bin/python training/train.py --family idlm --out /work/trained/mbd-idlm-tiny --minutes 70 --threads 2
    /tmp/devenv/bin/python training/train.py --family qwen35 --out /work/trained/mbd-qwen35-tiny --minutes 80 --threads 2 \
        --tasks sort:1,reverse:1,add:2,repeat:1,count:2,hello:1     # then stage 2: --init, --minutes 30, --lr 0.001,
        # --tasks sort:1,reverse:0.5,repeat:0.5,hello:0.25,add:3,count:2 (the card's stage table)
    /tmp/devenv/bin/python training/train.py --check /work/trained/mbd-tiny-v2      # HF load + reference decode
    nohup bash training/cpu_run.sh > /work/trained/cpu_run.log 2>&1 &   # all three on CPU, ~110 min, --minutes
    bash training/gpu_run.sh                                             # all three on a GPU (writes to $OUT)
Sizes: tiny 4.62M parameters (hidden 256, 7 layers, 8 heads / 2 KV x 32, MLP 640, tied; 9.2 MB bf16); the twins
2.62M each (hidden 192, 6 layers, 6 heads / 2 KV x 32, MLP 576, untied head as the 7B originals; 5.2 MB bf16; the
idlm twin the same shape in Qwen3, with QK-norm).
--objectives, --blocks, --tasks, --layers, --inter and --lr override the family's mixture and size (recorded in
training_log.json and the card).
Tools family: --tool-mix (the sample kinds' weights), --made-up (the fraction of made-up city names in training;
evaluation keeps tool_tasks.MADE_UP) and --city-weight (the loss weight of the city's characters in calls and
results; 1: every supervised token alike, then the loss is the plain mean as before). --bf16: the forward under bf16
autocast (weights, gradients and AdamW stay f32; the loss in f32): on the AVX-512 CPU host a step of the tools twin
takes 1.5 s instead of 3.1 on one thread. All recorded in training_log.json's stage and the card.
--resume continues from OUT/train_state.pt (model, optimiser, data RNG) up to the new --steps (the cosine schedule
is recomputed for the new total). A checkpoint (HF dir + train_state.pt + README.md card) is written every
--save-every steps / --save-minutes minutes, so partial progress is usable. OUT/train.log has the loss curve.
How each committed model was trained, stage by stage: training/README.md and the model's card (README.md in its
directory).
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config,
                          Qwen3ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import CHAT_TEMPLATE, TASKS, V1_TASKS, correct, held_out_set, render, sample  # noqa: E402
import tool_tasks  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from reference.decoder import completion_tokens, reference_isd  # noqa: E402

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
MAX_POS = 256
EXTRA_PAD = 16           # block-causal families: canvas = prompt + answer + <|im_end|> + U{0..EXTRA_PAD} pads
DREAM_CANVAS = 48        # full attention: in DREAM_LONG of the samples the answer region (answer + <|im_end|> + pads)
DREAM_LONG = 0.25        # is U{len(answer)+1..48} positions long (as max_tokens up to 48 gives), else as EXTRA_PAD
TASK_WEIGHTS = {"sort": 1.0, "reverse": 1.0, "repeat": 1.0, "hello": 1.0, "add": 2.0, "count": 1.0,
                "shuffle": 1.5}   # the tiny family's mix (v3; v2 had no shuffle, hello 0.5, count 2)
UNIFORM_TASKS = {t: 1.0 for t in V1_TASKS}   # v1's mix (the twins')
T_EPS = 1e-3
ROW_LEN = 96             # packed row length (a family's "row" overrides it)
FULL_OBJECTIVES = ("dream", "dream_prog")   # full bidirectional attention over the whole canvas
STAGE_KEYS = ("step", "steps", "minutes", "batch", "lr", "device", "threads", "train_seconds", "loss_ema", "objectives",
              "blocks", "tasks", "seed", "ce_alpha", "tool_mix", "made_up", "city_weight", "precision")     # a training stage's record in training_log.json (--init continues the list)

FAMILIES = {
    "tiny": dict(
        arch="qwen3", hidden=256, layers=7, heads=8, kv_heads=2, head_dim=32, inter=640, tie=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"], mask_str="<|mask|>", mask_last=False,
        pad="<|endoftext|>", shift=False, objectives={"d2f": 3, "bd3": 1}, blocks={1: 1, 2: 1, 4: 3, 8: 2, 16: 1},
        tasks=TASK_WEIGHTS, lr=2e-3, eval_block=4, name="mbd-tiny v3"),
    "dream": dict(
        arch="qwen2", hidden=192, layers=6, heads=6, kv_heads=2, head_dim=32, inter=576, tie=False, lr=5e-4,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], mask_str="<|mask|>", mask_last=True,
        pad="<|endoftext|>", shift=True, objectives={"dream": 1, "dream_prog": 1}, blocks={1: 1, 2: 1, 4: 2, 8: 1},
        tasks=UNIFORM_TASKS, eval_block=8, row=128,
        name="mbd-dream-tiny (Dream-style twin)"),
    "fast_dllm_v2": dict(
        arch="qwen2", hidden=192, layers=6, heads=6, kv_heads=2, head_dim=32, inter=576, tie=False, lr=5e-4,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], mask_str="|<MASK>|", mask_last=True,
        pad="<|im_end|>", shift=True, objectives={"bd3c": 1, "d2f": 1}, blocks={1: 1, 2: 1, 4: 2, 8: 2},
        tasks=UNIFORM_TASKS, eval_block=8, bd_size=8,
        name="mbd-fdv2-tiny (Fast-dLLM-v2-style twin)"),
    # Qwen3.5 hybrid: Gated DeltaNet layers (causal: a recurrence cannot see ahead) beside gated softmax attention
    # (block-causal), as arcLM-0.8B converts Qwen3.5-0.8B. d2f only: bd3's clean copy would follow the noisy one in
    # the GDN's order. Unpacked rows: a recurrence would carry one sample's state into the next.
    "qwen35": dict(
        # Sized for a CPU run (~0.9 s a step of 48 on 2 cores): a GDN layer's cost grows with its value heads, so 2
        # key heads serve 4 value heads (Hv > Hk, as Qwen3.5's 16/32). Softmax attention in every second layer
        # (Qwen3.5 has it in every fourth): with two of eight, 95 minutes of CPU did not teach the twin to count
        # (benches/results/models-twins.md, the Qwen3.5 twin's entries).
        arch="qwen35", hidden=192, layers=8, heads=6, kv_heads=2, head_dim=32, inter=512, tie=True,
        linear=dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=2),
        rotary=0.5, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"], mask_str="<|mask|>",
        mask_last=False, pad="<|endoftext|>", shift=False, objectives={"d2f": 1}, blocks={1: 1, 2: 1, 4: 3, 8: 2, 16: 1},
        tasks=UNIFORM_TASKS, lr=2e-3, eval_block=8, unpacked=True, gdn_chunk=32,
        name="mbd-qwen35-tiny (Qwen3.5 hybrid twin)"),
    # I-DLM (arXiv 2604.11035): Qwen3 weights under SDARForCausalLM, strictly causal, shifted logits; trained on
    # [all-masked answer | clean sequence] (objective idlm). Blocks = masks per noisy block (I-DLM's block_size; a
    # model of block size b serves ISD strides up to b + 1): the mix covers strides 2..8.
    "idlm": dict(
        arch="qwen3", hidden=192, layers=6, heads=6, kv_heads=2, head_dim=32, inter=576, tie=False, lr=2e-3,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], mask_str="<|mask|>", mask_last=True,
        pad="<|endoftext|>", shift=True, objectives={"idlm": 1}, blocks={1: 1, 2: 1, 3: 2, 5: 1, 7: 1},
        tasks=UNIFORM_TASKS, eval_block=3, ce_alpha=1.0,
        name="mbd-idlm-tiny (I-DLM-style twin)"),
    # the tools twin: mbd-tiny's layout, tokenizer and specials, warm-started from its weights (--init), a 512-token
    # context and TOOLS_TEMPLATE (training/tool_tasks.py); samples drawn by kind (tool_mix), old tasks at tiny's mix
    "tools": dict(
        arch="qwen3", hidden=256, layers=7, heads=8, kv_heads=2, head_dim=32, inter=640, tie=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"], mask_str="<|mask|>", mask_last=False,
        pad="<|endoftext|>", shift=False, objectives={"d2f": 3, "bd3": 1}, blocks={1: 1, 2: 1, 4: 3, 8: 2, 16: 1},
        tasks=TASK_WEIGHTS, lr=1e-3, eval_block=4, max_pos=512, row=256,
        tool_mix={"call": 0.35, "result": 0.3, "plain": 0.15, "bare": 0.2},
        chat_template=tool_tasks.TOOLS_TEMPLATE, name="mbd-tools-tiny (tool calls)"),
}


def layer_masks(spec, mask):
    """transformers' Qwen3.5 takes a mask per layer type: the block mask for the softmax layers; the GDN layers get
    none (causal)."""
    if spec["arch"] == "qwen35":
        return {"full_attention": mask, "linear_attention": None}
    return mask


# ----------------------------------------------------------------------------------------------------- tokenizer
def make_tokenizer(spec):
    """Character-level: the specials, the 95 printable ASCII characters and newline (v1's 100-token vocabulary for
    the tiny family; the twins put their mask token last instead of at id 3)."""
    specials = spec["specials"] + ([spec["mask_str"]] if spec["mask_last"] else [])
    toks = spec["specials"] + CHARS + ([spec["mask_str"]] if spec["mask_last"] else [])
    vocab = {t: i for i, t in enumerate(toks)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    return tok


class Ids:
    def __init__(self, tok, spec):
        self.tok = tok
        self.endoftext = tok.token_to_id("<|endoftext|>")
        self.im_start = tok.token_to_id("<|im_start|>")
        self.im_end = tok.token_to_id("<|im_end|>")
        self.mask = tok.token_to_id(spec["mask_str"])
        self.pad = tok.token_to_id(spec["pad"])
        self.eos = sorted({self.im_end, self.endoftext})
        self.vocab = tok.get_vocab_size()

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------------------- data
def pick(r, weights):
    keys = list(weights)
    return r.choices(keys, weights=[weights[k] for k in keys])[0]


def draw_samples(r, ids, n, tasks, full=False, tool_mix=None, made_up=None, city_weight=1.0):
    """n training instances: (prompt ids, target ids = answer ++ <|im_end|> ++ pads up to the canvas end).
    full (full attention): every position of the canvas is seen, so in DREAM_LONG of the samples the canvas spans
    what max_tokens does at inference (up to DREAM_CANVAS), not just a few pads past the answer (the rest keep the
    short canvases: mostly-pad canvases spend the compute on trivially predicted pads).
    tool_mix (the tools family): the kind of each sample drawn by these weights (training/tool_tasks.py), the
    prompt rendered with its template; made_up the fraction of made-up city names (None: tool_tasks.MADE_UP).
    city_weight != 1: a third element, the loss weight of each answer-region token (the city's characters in a
    call or a result weigh city_weight, the others 1; characters are tokens here)."""
    out = []
    for _ in range(n):
        span = None
        if tool_mix:
            p, a, span = tool_tasks.draw(r, pick(r, tool_mix), held_out=False, task_weights=tasks, made_up=made_up,
                                         with_city=True)
            pr = ids.encode(p)
        else:
            _, p, a = sample(r, held_out=False, task=pick(r, tasks))
            pr = ids.encode(render(p))
        an = ids.encode(a) + [ids.im_end]
        if full and r.random() < DREAM_LONG:
            extra = r.randint(0, max(0, DREAM_CANVAS - len(an)))
        else:
            extra = r.randint(0, EXTRA_PAD)
        an = an + [ids.pad] * extra
        if city_weight == 1.0:
            out.append((pr, an))
            continue
        w = torch.ones(len(pr) + len(an))
        if span is not None:
            w[len(pr) + span[0]:len(pr) + span[1]] = city_weight
        out.append((pr, an, w))
    return out


def block_t(g, nblocks, sort):
    t = T_EPS + (1 - T_EPS) * torch.rand((nblocks,), generator=g)
    return t.sort().values if sort else t


def noise(r, g, samples, obj, B):
    """Decide every sample's masked positions before packing. Returns a list of
    (tokens, lp, masked bool tensor, per-token loss weight or None); bd3c returns each sample twice (m, complement)."""
    out = []
    if obj == "dream":
        n = len(samples)
        u0 = torch.rand((), generator=g)
        ts = T_EPS + (1 - T_EPS) * ((u0 + torch.arange(n) / n) % 1.0)             # stratified over the batch
        ts = ts[torch.randperm(n, generator=g)]
    for i, (p, a, *tw) in enumerate(samples):
        toks, lp = p + a, len(p)
        tw = tw[0] if tw else None   # per-token loss weights (d2f/bd3/bd3c only)
        n = len(toks)
        ans = torch.arange(n) >= lp
        u = torch.rand((n,), generator=g)
        if obj == "dream":
            t = float(ts[i])
            out.append((toks, lp, ans & (u < t), 1.0 / t))
            continue
        if obj == "dream_prog":  # blocks of B from the answer's start (prompt-aligned, as full-attention decoding)
            blk = (torch.arange(n) - lp).clamp(min=0) // B
            t = block_t(g, int(blk[-1]) + 1, sort=True)
            out.append((toks, lp, ans & (u < t[blk]), None))
            continue
        if obj == "idlm":  # I-DLM's all-masked noisy copy: every answer position is a mask
            out.append((toks, lp, ans, None))
            continue
        blk = torch.arange(n) // B
        t = block_t(g, int(blk[-1]) + 1, sort=obj == "d2f" and r.random() < 0.5)
        m = ans & (u < t[blk])
        out.append((toks, lp, m, tw))
        if obj == "bd3c":
            out.append((toks, lp, ans & ~m, tw))
    return out


def pack(items, row_len):
    """First-fit packing of samples into rows (no padding waste); position ids restart at 0 in every sample and
    attention never crosses samples. Returns per-row lists of (offset, item)."""
    rows = []
    for it in items:
        n = len(it[0])
        for row in rows:
            if row[0] + n <= row_len:
                row[1].append((row[0], it))
                row[0] += n
                break
        else:
            rows.append([n, [(0, it)]])
    return [r[1] for r in rows]


def build(items, obj, B, shift, ids, row_len, unpacked=False, ce_alpha=1.0):
    """Model inputs (ids, additive 4-D mask, position ids) and the loss selection for packed samples (unpacked: one
    sample per row, padded at its end, for recurrent layers).
    d2f: block-causal on one noisy copy; dream: full attention on one noisy copy; bd3/bd3c/idlm: noisy ++ clean (2R).
    idlm (shifted): the noisy rows of masked positions p predict token p + 1; the clean rows of positions lp - 1 ..
    n - 2 predict the next token (AR), weighted ce_alpha; both summed over the sample's answer length."""
    if unpacked:
        R = max(len(it[0]) for it in items)
        rows = [[(0, it)] for it in items]
    else:
        R = max(row_len, max(len(it[0]) for it in items))
        rows = pack(sorted(items, key=lambda it: -len(it[0])), R)
    nr = len(rows)
    two = obj in ("bd3", "bd3c", "idlm")
    W = 2 * R if two else R
    inp = torch.full((nr, W), ids.pad, dtype=torch.long)
    pos = torch.zeros((nr, W), dtype=torch.long)
    seg = torch.full((nr, W), -1, dtype=torch.long)
    clean = torch.zeros((nr, W), dtype=torch.bool)
    bi, rw, tg, wt = [], [], [], []
    norm = 0
    for k, row in enumerate(rows):
        for j, (o, (toks, lp, m, w)) in enumerate(row):
            n = len(toks)
            x = torch.tensor(toks)
            noisy = torch.where(m, torch.full_like(x, ids.mask), x)
            inp[k, o:o + n] = noisy
            pos[k, o:o + n] = torch.arange(n)
            seg[k, o:o + n] = j
            if two:
                inp[k, R + o:R + o + n] = x
                pos[k, R + o:R + o + n] = torch.arange(n)
                seg[k, R + o:R + o + n] = j
                clean[k, R + o:R + o + n] = True
            mp = m.nonzero().flatten()
            if obj == "idlm":
                mp = mp[mp + 1 < n]                      # a mask row predicts the next position
                cp = torch.arange(lp - 1, n - 1)         # clean rows predicting the answer (AR)
                bi.append(torch.full((len(mp) + len(cp),), k))
                rw.append(torch.cat([o + mp, R + o + cp]))
                tg.append(torch.cat([x[mp + 1], x[cp + 1]]))
                wt.append(torch.cat([torch.ones(len(mp)), torch.full((len(cp),), float(ce_alpha))]))
                norm += n - lp
                continue
            if shift:
                src = o + mp - 1
                if two:  # first position of a block: the clean copy's previous position
                    src = torch.where(mp % B == 0, R + o + mp - 1, src)
            else:
                src = o + mp
            bi.append(torch.full_like(mp, k))
            rw.append(src)
            tg.append(x[mp])
            wt.append(w[mp] if torch.is_tensor(w) else torch.full((len(mp),), 1.0 if w is None else w))
            norm += n - lp
    blk = pos // B
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    bq, bk = blk[:, :, None], blk[:, None, :]
    cq, ck = clean[:, :, None], clean[:, None, :]
    pq, pk = pos[:, :, None], pos[:, None, :]
    if obj in FULL_OBJECTIVES:
        rule = torch.ones_like(same)
    elif obj == "idlm":  # strictly causal within a noisy block and over the clean copy
        rule = (~cq & ~ck & (bk == bq) & (pk <= pq)) | (~cq & ck & (bk < bq)) | (cq & ck & (pk <= pq))
    elif two:
        rule = (~cq & ~ck & (bk == bq)) | (~cq & ck & (bk < bq)) | (cq & ck & (bk <= bq))
    else:
        rule = bk <= bq
    allowed = (same & rule) | torch.eye(W, dtype=torch.bool)[None]
    sel = (torch.cat(bi), torch.cat(rw), torch.cat(tg), torch.cat(wt), torch.tensor(float(norm)) if obj in ("dream", "idlm") else None)
    return inp, additive(allowed), pos, sel


def additive(allowed):
    m = torch.zeros(allowed.shape, dtype=torch.float32)
    m.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return m[:, None]


def make_batch(r, g, ids, spec, bsz):
    """One training batch of `bsz` sequences (bd3c: bsz/2 samples, each with its complementary twin)."""
    obj = pick(r, spec["objectives"])
    B = pick(r, spec["blocks"])
    n = bsz // 2 if obj == "bd3c" else bsz
    items = noise(r, g, draw_samples(r, ids, n, spec["tasks"], full=obj in FULL_OBJECTIVES,
                                     tool_mix=spec.get("tool_mix"), made_up=spec.get("made_up"),
                                     city_weight=spec.get("city_weight", 1.0)), obj, B)
    inp, mask, posid, sel = build(items, obj, B, spec["shift"], ids, spec.get("row", ROW_LEN), spec.get("unpacked", False),
                                  spec.get("ce_alpha", 1.0))
    return obj, B, inp, mask, posid, sel


def loss_of(logits, sel):
    bi, rows, tgt, w, norm = (v.to(logits.device) if v is not None else None for v in sel)
    ce = F.cross_entropy(logits[bi, rows].float(), tgt, reduction="none")
    if norm is None:   # mean over the supervised positions (weighted where --city-weight gave weights)
        return ce.mean() if bool((w == 1).all()) else (ce * w).sum() / w.sum()
    return (ce * w).sum() / norm


# --------------------------------------------------------------------------------------------------------- model
def build_model(spec, ids):
    kw = dict(vocab_size=ids.vocab, hidden_size=spec["hidden"], intermediate_size=spec["inter"],
              num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
              max_position_embeddings=spec.get("max_pos", MAX_POS), rope_theta=10000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=spec["tie"], pad_token_id=ids.pad, bos_token_id=ids.endoftext)
    if spec["arch"] == "qwen35":
        kw.pop("rope_theta")
        cfg = Qwen3_5TextConfig(head_dim=spec["head_dim"], eos_token_id=[ids.im_end, ids.endoftext], **kw,
                                **spec["linear"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": spec["rotary"]})
        model = Qwen3_5ForCausalLM(cfg)
        gdn_chunk(spec.get("gdn_chunk", 64))
    elif spec["arch"] == "qwen3":
        cfg = Qwen3Config(head_dim=spec["head_dim"], eos_token_id=[ids.im_end, ids.endoftext], **kw)
        model = Qwen3ForCausalLM(cfg)
    else:
        assert spec["hidden"] == spec["heads"] * spec["head_dim"], "Qwen2 has no head_dim field"
        cfg = Qwen2Config(eos_token_id=ids.im_end, **kw)
        model = Qwen2ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def gdn_chunk(size):
    """transformers' torch fallback for the gated delta rule pads a sequence to a multiple of its chunk (64) and
    scans the chunks; any chunk size gives the same result up to rounding. Rows here are ~70 tokens, so 32 wastes
    less padding (measured on 2 cores: 1.82 -> 1.64 s a step of the 6M model). Set by build_model, so for the
    training process (its evaluations included); a checkpoint loaded elsewhere runs transformers' default."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    orig = getattr(mq, "_mbd_chunk_rule", mq.torch_chunk_gated_delta_rule)
    mq._mbd_chunk_rule = orig
    mq.torch_chunk_gated_delta_rule = orig if size == 64 else (lambda *a, **k: orig(*a, **{**k, "chunk_size": size}))


def ordinal(n):
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def hf_class(spec):
    return {"qwen3": Qwen3ForCausalLM, "qwen35": Qwen3_5ForCausalLM}.get(spec["arch"], Qwen2ForCausalLM)


def family_config(family, spec, ids, cfg):
    """config.json as the family's real checkpoints write it (plus the Qwen fields our loader and transformers read)."""
    cfg = dict(cfg)
    cfg["dtype"] = "bfloat16"
    if family in ("tiny", "tools"):
        cfg.update(block_size=4, mask_token_id=ids.mask, mbd_family="mbd-tiny", mbd_tiny_version=2,
                   eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.pad, bos_token_id=ids.endoftext)
        return cfg
    if family == "idlm":
        # I-DLM-8B's config.json: SDARForCausalLM, model_type sdar, block_size (masks per noisy block: 3 for ISD
        # stride 4, as idlm_blockN4), mask_token_id, legacy rope fields (transformers 4.51). Nothing in it says
        # "causal, shifted": the engine loads it with attention="causal", logits_shift=True, as a real I-DLM model.
        rp = cfg.pop("rope_parameters", None) or {}
        cfg.pop("layer_types", None)
        # (use_regular_causal: I-DLM's SDARConfig adds it, default true, and save_pretrained writes it)
        cfg.update(architectures=["SDARForCausalLM"], model_type="sdar", block_size=spec["eval_block"],
                   mask_token_id=ids.mask, use_regular_causal=True, rope_theta=rp.get("rope_theta", 10000.0),
                   rope_scaling=None,
                   use_sliding_window=False, sliding_window=None, torch_dtype="bfloat16",
                   eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.pad, bos_token_id=ids.endoftext)
        return cfg
    if family == "qwen35":
        # a block-diffusion conversion of Qwen3.5: its own config plus the diffusion fields (block-causal, unshifted)
        cfg.update(block_size=4, mask_token_id=ids.mask, logits_shift=False, eos_token_id=[ids.im_end, ids.endoftext],
                   pad_token_id=ids.pad, bos_token_id=ids.endoftext)
        return cfg
    # Qwen2-based families: legacy rope fields as in the real (transformers 4.x era) configs.
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    if family == "dream":
        cfg.pop("layer_types", None)
    cfg.update(use_sliding_window=False, sliding_window=None, torch_dtype="bfloat16")
    if family == "dream":
        # Dream-v0 / d3LLM_Dream / DiffuCoder config.json: DreamModel, model_type "Dream", mask_token_id in config,
        # eos = pad = bos = <|endoftext|>. (No auto_map: we ship no modeling_dream.py.)
        cfg.update(architectures=["DreamModel"], model_type="Dream", mask_token_id=ids.mask,
                   eos_token_id=ids.endoftext, pad_token_id=ids.endoftext, bos_token_id=ids.endoftext, use_mrope=False)
    else:
        # Fast_dLLM_v2_7B config.json: bd_size, conplemenrary_mask (sic), eos = pad = <|im_end|>, bos <|endoftext|>,
        # no mask_token_id (the loader finds |<MASK>| in the tokenizer). (No auto_map either.)
        cfg.update(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=spec["bd_size"],
                   conplemenrary_mask=True, eos_token_id=ids.im_end, pad_token_id=ids.im_end, bos_token_id=ids.endoftext)
        cfg.pop("mask_token_id", None)
    return cfg


def save_checkpoint(model, out, family, spec, ids):
    """The HF directory, weights in bf16."""
    os.makedirs(out, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).clone() for k, v in model.state_dict().items()}
    clone = hf_class(spec)(model.config)
    clone.load_state_dict({k: v.float() for k, v in sd.items()})
    clone.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    cpath = os.path.join(out, "config.json")
    cfg = family_config(family, spec, ids, json.load(open(cpath)))
    json.dump(cfg, open(cpath, "w"), indent=2, sort_keys=True)
    ids.tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": spec["pad"],
               "mask_token": spec["mask_str"], "chat_template": spec.get("chat_template", CHAT_TEMPLATE),
               "model_max_length": spec.get("max_pos", MAX_POS)},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
    gen = {"bos_token_id": ids.endoftext, "eos_token_id": [ids.im_end, ids.endoftext], "pad_token_id": ids.pad}
    if family == "fast_dllm_v2":
        gen["eos_token_id"] = [ids.im_end]
    json.dump(gen, open(os.path.join(out, "generation_config.json"), "w"), indent=1)


# -------------------------------------------------------------------------------------------- reference decoding
def canvas_mask(L, attention, B):
    """(1, 1, L, L) additive mask; full attention is passed explicitly (None would mean causal to transformers)."""
    pos = torch.arange(L)
    if attention == "full":
        return additive(torch.ones((1, L, L), dtype=torch.bool))
    blk = pos // B
    return additive((blk[None, :] <= blk[:, None])[None])


def gen_blocks(lp, N, B, attention):
    """Generation blocks as docs/decoding.md defines them (absolute grid for block-causal, prompt-aligned else)."""
    end = lp + N
    if attention == "block_causal":
        first = min(end, (lp // B + 1) * B)
        out, s = [(lp, first)], first
    else:
        out, s = [], lp
    while s < end:
        out.append((s, min(s + B, end)))
        s += B
    return out


@torch.no_grad()
def ref_generate(model, ids, shift, attention, prompt_ids, N=40, B=4, tau=None):
    """Simple reference decoder (semi-AR, one block at a time, whole canvas recomputed each forward): in the first
    block with masks, decode the most confident masked position (tau=None) or every position with max-prob > tau
    (and at least the most confident one). Stops once an EOS is decoded with nothing masked before it.
    Returns (answer text, answer token count, forwards)."""
    dev = next(model.parameters()).device
    lp = len(prompt_ids)
    x = torch.tensor(prompt_ids + [ids.mask] * N, device=dev)[None]
    decoded = [False] * N
    am = canvas_mask(lp + N, attention, B).to(dev)
    blocks = gen_blocks(lp, N, B, attention)
    fwd = 0
    eos = set(ids.eos)
    while True:
        masked = [lp + i for i in range(N) if not decoded[i]]
        e = next((i for i in range(N) if decoded[i] and int(x[0, lp + i]) in eos), None)
        if not masked or (e is not None and all(p > lp + e for p in masked)):
            break
        s, t_end = next(b for b in blocks if any(b[0] <= p < b[1] for p in masked))
        cand = [p for p in masked if s <= p < t_end]
        logits = model(x, attention_mask=layer_masks(spec_of(model), am)).logits[0].float()
        fwd += 1
        rows = torch.tensor([p - 1 if shift else p for p in cand], device=dev)
        lg = logits[rows]
        lg[:, ids.mask] = float("-inf")          # the mask token is never a prediction
        conf, tok = lg.softmax(-1).max(-1)
        acc = conf > tau if tau is not None else torch.zeros_like(conf, dtype=torch.bool)
        acc[conf.argmax()] = True
        for j in acc.nonzero().flatten().tolist():
            x[0, cand[j]] = tok[j]
            decoded[cand[j] - lp] = True
    toks = x[0, lp:].tolist()
    e = next((i for i in range(N) if decoded[i] and toks[i] in eos), N)
    return ids.tok.decode(toks[:e]), e + 1, fwd


def spec_of(model):
    """The arch a loaded model has, for `layer_masks`."""
    return {"arch": "qwen35" if isinstance(model, Qwen3_5ForCausalLM) else "other"}


def attention_of(family):
    return {"dream": "full", "idlm": "causal"}.get(family, "block_causal")


def ref_isd(model, ids, prompt_ids, N, max_new=40):
    """Greedy ISD at stride N (1: AR) by tests/reference/decoder.py's `reference_isd`. Returns (text, tokens up to
    and with the EOS, forwards)."""
    written, fwd = reference_isd(model, prompt_ids, n=max_new, mask_id=ids.mask, stride=N, eos_ids=set(ids.eos))
    done = completion_tokens(written, ids.eos)
    return ids.tok.decode(done), min(len(done) + 1, len(written)), fwd


def evaluate(model, family, spec, ids, per_task=20, taus=(None, 0.9)):
    """Held-out accuracy and tokens per forward of each reference decoding: semi-AR blocks at each tau, or for the
    idlm family greedy AR (stride 1) and greedy ISD at larger strides, which must write AR's text."""
    model.eval()
    res = {}
    data = held_out_set(per_task)
    if family == "idlm":
        decodings = [("AR (one token per forward)" if n == 1 else f"ISD stride {n} (greedy)",
                      lambda pr, n=n: ref_isd(model, ids, pr, n)) for n in (1, 2, 4, 8)]
    else:
        decodings = [("one token per forward" if tau is None else f"max-prob > {tau}",
                      lambda pr, tau=tau: ref_generate(model, ids, spec["shift"], attention_of(family), pr, N=40,
                                                       B=spec["eval_block"], tau=tau)) for tau in taus]
    first = None
    for key, decode in decodings:
        per = {t: [0, 0] for t in TASKS}
        toks = fwd = 0
        texts = []
        for task, p, a in data:
            text, n, f = decode(ids.encode(render(p)))
            texts.append(text)
            per[task][0] += correct(task, p, a, text)
            per[task][1] += 1
            toks += n
            fwd += f
        first = first or texts
        assert family != "idlm" or texts == first, f"greedy {key} wrote other text than greedy AR"
        res[key] = dict(accuracy=sum(v[0] for v in per.values()) / len(data), tokens_per_forward=toks / max(fwd, 1),
                        per_task={k: v[0] / max(v[1], 1) for k, v in per.items()})
    return dict(block_size=spec["eval_block"], instances=len(data), results=res)


# ----------------------------------------------------------------------------------------------------- the card
def stage_kinds(sg):
    """A tools stage's sample kinds, made-up share and city weight, for the stage table's tasks column."""
    if not sg.get("tool_mix"):
        return ""
    return (f"; kinds {sg['tool_mix']}" + (f", made-up cities {sg['made_up']:g}" if sg.get("made_up") is not None else "")
            + (f", city weight {sg['city_weight']:g}" if sg.get("city_weight") not in (None, 1, 1.0) else ""))


def write_card(out, family, spec, ids, st):
    ev = st.get("eval")
    lines = [f"# {spec['name']}", "",
             f"Trained by `training/train.py --family {family}` (mbd-rs), seeded. Status: **{st['status']}** "
             f"(step {st['step']} of {st['steps']}).", "",
             "## Format",
             f"- Weights: {dict(qwen3='Qwen3', qwen35='Qwen3.5 hybrid').get(spec['arch'], 'Qwen2')} "
             f"(`{hf_class(spec).__name__}` loads `model.safetensors` with no missing/unexpected keys), bf16, "
             f"{st['parameters'] / 1e6:.2f}M parameters: hidden {spec['hidden']}, {spec['layers']} layers, "
             f"{spec['heads']} heads / {spec['kv_heads']} KV heads x {spec['head_dim']}, MLP {spec['inter']}, "
             f"{'tied' if spec['tie'] else 'untied'} head, vocabulary {ids.vocab} (characters + specials).",
             *([f"- Layers: every {ordinal(spec['linear']['full_attention_interval'])} gated softmax attention (RoPE over "
                f"{spec['rotary']:g} of each head), the others Gated DeltaNet ({spec['linear']['linear_num_key_heads']} "
                f"key / {spec['linear']['linear_num_value_heads']} value heads x {spec['linear']['linear_key_head_dim']}, "
                f"convolution {spec['linear']['linear_conv_kernel_dim']}), causal whatever the mask."]
              if spec["arch"] == "qwen35" else []),
             f"- Family profile: attention {attention_of(family)}"
             f"{', aligned at absolute position 0' if attention_of(family) == 'block_causal' else ''}; logits "
             f"{'shifted (position i predicts token i+1)' if spec['shift'] else 'unshifted (position i predicts token i)'}; "
             f"mask token `{spec['mask_str']}` = {ids.mask}"
             f"{' (tokenizer only; config.json has none, as Fast-dLLM v2)' if family == 'fast_dllm_v2' else ' (config mask_token_id)'}; "
             f"EOS ids {ids.eos if family != 'fast_dllm_v2' else [ids.im_end]}; pad `{spec['pad']}`.",
             *(["- As a real I-DLM checkpoint (`SDARForCausalLM`, `block_size` "
                f"{spec['eval_block']} = ISD stride {spec['eval_block'] + 1}), config.json does not say that the "
                "model is causal and shifted: load it with `mbd_rs.Engine.load(path, attention=\"causal\", "
                "logits_shift=True)` and decode with `speculative=\"isd\"`."] if family == "idlm" else []),
             *(["- Chat template: `<|im_start|>{role}\\n{content}<|im_end|>\\n`, generation prompt "
                "`<|im_start|>assistant\\n` (v1's)."] if family != "tools" else [
                 "- Chat template: `TOOLS_TEMPLATE` of training/tool_tasks.py: v1's `<|im_start|>{role}\\n{content}"
                 "<|im_end|>\\n` turns; with `tools`, first a system turn listing them compactly (`tools: "
                 "get_weather(city) get_time(city)`: each function's name and parameter names, not its schema); an "
                 "assistant's `tool_calls` as Hermes' `<tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n"
                 "</tool_call>` (the layout of the engine's tool grammar), a tool's answer as a `tool` turn. "
                 f"Context {spec.get('max_pos', MAX_POS)} positions (mbd-tiny has {MAX_POS})."]), "",
             "## Data",
             *([f"Sample kinds (training/tool_tasks.py), weights {spec['tool_mix']} (the last stage's; the stage table "
                "has each stage's): `call` a weather or time "
                "request for a city (real and made-up names"
                f"{'' if spec.get('made_up') is None else ', made-up in ' + format(spec['made_up'], '.0%') + ' of the samples of the last stage'}"
                "; varied phrasings) with the tools listed, answered by "
                "the call; `result` the same conversation with the call and the tool's JSON answer, answered in "
                "words (\"It is 18 degrees and sunny in Paris.\"); `plain` an old task with the tools listed and "
                "`bare` one without, answered as before (no call). "
                + (f"In the last stage the city's characters in a call or a result weigh {spec['city_weight']:g} in "
                   "the loss (the other supervised tokens 1). " if spec.get("city_weight", 1) != 1 else "")
                + "Held out as the old tasks: a user message whose "
                "character codes sum to a multiple of 7 never occurs in training. Old tasks:"]
               if family == "tools" else []),
             f"`training/tasks.py` task families ({', '.join(spec['tasks'])}), training split only: a prompt "
             "is held out iff the sum of its character codes is a multiple of 7. Task weights "
             + ", ".join(f"{k} {v}" for k, v in spec["tasks"].items()) + ". Fresh samples every step "
             f"(about {sum(sg['step'] * sg['batch'] for sg in st.get('stages') or [st])} sequences seen).", "",
             "## Training",
             f"Objectives {spec['objectives']} (see the docstring of training/train.py), block sizes {spec['blocks']}"
             f"{' (the blocks of dream_prog; dream has none)' if family == 'dream' else ''}. Batch {st['batch']}, AdamW lr {st['lr']} "
             f"(warm-up 100, cosine over {st['steps']} steps"
             f"{' or ' + str(st['minutes']) + ' minutes of wall time, whichever ends first' if st.get('minutes') else ''}), "
             f"weight decay 0.01, clip 1.0{', forward in bf16 autocast' if st.get('precision') == 'bf16 autocast' else ''}. "
             f"Steps done: {st['step']}. Device {st['device']}, "
             f"{st['train_seconds'] / 60:.1f} min. Loss (EMA 0.98) at the last step: {st['loss_ema']:.4f}. "
             "Loss curve: `train.log`.", ""]
    if len(st.get("stages", [])) > 1:
        lines += ["Stages (each a warm restart from the previous stage's bf16 weights, `--init`: fresh optimiser, "
                  "warm-up and cosine again):", "",
                  "| stage | steps | minutes | device, threads | lr | objectives | block sizes | tasks | loss at end |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, sg in enumerate(st["stages"]):
            lines.append(f"| {k + 1} | {sg['step']} | {sg['train_seconds'] / 60:.0f} | {sg['device']}"
                         f"{' (bf16 autocast)' if sg.get('precision') == 'bf16 autocast' else ''}, "
                         f"{sg.get('threads')} | {sg.get('lr')} | {sg.get('objectives')} | {sg.get('blocks', '-')} | "
                         f"{sg.get('tasks', '-')}{stage_kinds(sg)} | {sg['loss_ema']:.4f} |")
        lines.append("")
    lines += [
             "## Results (held-out split, PyTorch reference decoder of training/train.py)"]
    if ev:
        lines.append(f"Block size {ev['block_size']}, {ev['instances']} held-out instances, max 40 new tokens, "
                     "exact match (shuffle: the given letters in any order, each once).")
        lines.append("")
        # a family outside this model's training mix (the twins learned v1's six) is marked untrained
        lines.append("| decoding | accuracy | tokens/forward | "
                     + " | ".join(t if t in spec["tasks"] else f"{t} (untrained)" for t in TASKS) + " |")
        lines.append("|---|---|---|" + "---|" * len(TASKS))
        for k, v in ev["results"].items():
            lines.append(f"| {k} | {100 * v['accuracy']:.1f}% | {v['tokens_per_forward']:.2f} | "
                         + " | ".join(f"{100 * v['per_task'][t]:.0f}" for t in TASKS) + " |")
    else:
        lines.append("(not evaluated yet)")
    te = os.path.join(out, "tool_eval.json")
    if family == "tools" and os.path.exists(te):
        tv = json.load(open(te))
        lines += ["", "## Tool calls (the engine, `training/eval_tools.py`)",
                  f"Held-out prompts: {tv['held_out_calls']} weather/time requests with the tools listed and "
                  f"`tool_choice=\"auto\"` (right: one call, the right function, `{{\"city\": <the city>}}`), "
                  f"{tv['held_out_round_trips']} conversations ending in the tool's answer (right: words, no call, "
                  f"with the answer's values and the city), {tv['old_per_task']} held-out instances per old task "
                  "family (tasks.correct; with the tools listed too, where no call is right).", "",
                  "| decoding | calls | calls naming the right function | round trip | round trip, values stated "
                  "| old tasks | old tasks, tools listed | tokens/forward |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in tv["results"].items():
            lines.append(f"| {k} | {100 * v['calls']:.0f}% | {100 * v['calls_right_function']:.0f}% | "
                         f"{100 * v['round_trip']:.0f}% | {100 * v['round_trip_values']:.0f}% | {100 * v['old_tasks']:.0f}% | "
                         f"{100 * v['old_tasks_tools_listed']:.0f}% | {v['tokens_per_forward']:.2f} |")
    lines += ["", "Engine results (`benches/decoding/eval_tiny.py --model DIR`): benches/results/models-twins.md.", ""]
    open(os.path.join(out, "README.md"), "w").write("\n".join(lines))


# ---------------------------------------------------------------------------------------------------- training
class Batches(torch.utils.data.IterableDataset):
    """Endless training batches made in DataLoader worker processes (--workers > 0, for GPUs, where building batches
    in the training process would starve the device). Worker k draws from random.Random(seed * 1000 + k) and the
    loader takes the workers round-robin, so a run is reproducible for a given worker count (but not resumable mid-
    stream: a resumed run starts new streams)."""

    def __init__(self, spec, bsz, seed):
        self.spec, self.bsz, self.seed = spec, bsz, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k = info.id if info is not None else 0
        torch.set_num_threads(1)
        spec = self.spec
        ids = Ids(make_tokenizer(spec), spec)
        r = random.Random(self.seed * 1000 + k)
        g = torch.Generator().manual_seed(self.seed * 1000 + k + 1)
        while True:
            yield make_batch(r, g, ids, spec, self.bsz)


def mixture(text, key_type):
    """'k:v,k:v' -> {k: weight} (the --objectives / --blocks / --tasks overrides)."""
    return {key_type(k): float(v) for k, v in (kv.split(":") for kv in text.split(","))}


def family_spec(args):
    """The family's spec with the command line's overrides (recorded in training_log.json and the card)."""
    spec = dict(FAMILIES[args.family])
    if args.lr:
        spec["lr"] = args.lr
    if args.objectives:
        spec["objectives"] = mixture(args.objectives, str)
    if args.blocks:
        spec["blocks"] = mixture(args.blocks, int)
    if args.tasks:
        spec["tasks"] = mixture(args.tasks, str)
        assert set(spec["tasks"]) <= set(TASKS), f"unknown task in --tasks (known: {', '.join(TASKS)})"
    if args.tool_mix:
        assert spec.get("tool_mix"), "--tool-mix is for the tools family"
        spec["tool_mix"] = mixture(args.tool_mix, str)
        assert set(spec["tool_mix"]) <= {"call", "result", "plain", "bare"}, "kinds: call, result, plain, bare"
    if args.made_up is not None or args.city_weight is not None:
        assert spec.get("tool_mix"), "--made-up and --city-weight are for the tools family"
        if args.made_up is not None:
            spec["made_up"] = args.made_up
        if args.city_weight is not None:
            spec["city_weight"] = args.city_weight
    spec["precision"] = "bf16 autocast" if args.bf16 else "fp32"
    if args.layers:
        spec["layers"] = args.layers
    if args.inter:
        spec["inter"] = args.inter
    if args.ce_alpha is not None:
        spec["ce_alpha"] = args.ce_alpha
    return spec


def train(args):
    family, spec = args.family, family_spec(args)
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    r = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = Ids(make_tokenizer(spec), spec)
    model = build_model(spec, ids).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, "train_state.pt")
    start, ema, t_prev = 0, None, 0.0
    stages = []   # earlier training stages this run continues (--init), for the card
    if args.init:
        from safetensors.torch import load_file
        sd = load_file(os.path.join(args.init, "model.safetensors"))
        if spec["tie"]:
            sd.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        prev = json.load(open(os.path.join(args.init, "training_log.json")))
        stages = prev.get("stages") or [{k: prev.get(k) for k in STAGE_KEYS}]
    if args.resume and os.path.exists(state_path):
        s = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        r.setstate(s["py_rng"])
        g.set_state(s["torch_rng"])
        start, ema, t_prev = s["step"], s["ema"], s["train_seconds"]
    if args.workers > 0:
        batches = Batches(spec, args.batch, args.seed + start)
        loader = iter(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers, prefetch_factor=4,
                                                  persistent_workers=True))
        next_batch = lambda: next(loader)
    else:
        next_batch = lambda: make_batch(r, g, ids, spec, args.batch)
    warm = 100

    def progress(step):
        """Fraction of the schedule done: by steps, or by wall time when --minutes is given (whichever is further)."""
        p = step / args.steps
        if args.minutes:
            p = max(p, (time.time() - t0) / (60 * args.minutes))
        return min(1.0, p)

    lr_at = lambda s, p: spec["lr"] * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * p))
    log = open(os.path.join(args.out, "train.log"), "a")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    say(f"# {spec['name']}: family {family}, {n_params / 1e6:.3f}M parameters, device {dev}, threads {args.threads}, "
        f"workers {args.workers}, batch {args.batch}, lr {spec['lr']}, steps {args.steps}, seed {args.seed}, start {start}")
    t0 = time.time() - t_prev
    last_save = time.time()

    def checkpoint(step, status, do_eval):
        st = dict(status=status, step=step, steps=args.steps, minutes=args.minutes, batch=args.batch, lr=spec["lr"], device=str(dev),
                  train_seconds=time.time() - t0, loss_ema=ema if ema is not None else float("nan"), parameters=n_params,
                  family=family, seed=args.seed, objectives=spec["objectives"], threads=args.threads,
                  blocks=spec["blocks"], tasks=spec["tasks"], ce_alpha=spec.get("ce_alpha"), tool_mix=spec.get("tool_mix"),
                  made_up=spec.get("made_up"), city_weight=spec.get("city_weight"), precision=spec["precision"])
        st["stages"] = stages + [{k: st.get(k) for k in STAGE_KEYS}]
        if do_eval:
            te = time.time()
            st["eval"] = evaluate(model, family, spec, ids, per_task=args.eval_per_task)
            model.train()
            say(f"eval at step {step} ({time.time() - te:.0f}s): " + json.dumps(st["eval"]["results"]))
        save_checkpoint(model, args.out, family, spec, ids)
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), py_rng=r.getstate(), torch_rng=g.get_state(),
                        step=step, ema=ema, train_seconds=time.time() - t0), state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)
        json.dump(st, open(os.path.join(args.out, "training_log.json"), "w"), indent=1)
        write_card(args.out, family, spec, ids, st)
        say(f"saved {args.out} at step {step} ({status})")

    model.train()
    obj_ema = {}
    step = start
    while step < args.steps:
        prog = progress(step)
        if prog >= 1.0:
            break
        lr = lr_at(step, prog)
        for pg in opt.param_groups:
            pg["lr"] = lr
        obj, B, inp, mask, posid, sel = next_batch()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(inp.to(dev), attention_mask=layer_masks(spec, mask.to(dev)), position_ids=posid.to(dev)).logits
        loss = loss_of(logits, sel)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        obj_ema[obj] = lv if obj not in obj_ema else 0.95 * obj_ema[obj] + 0.05 * lv
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:6d} loss {ema:.4f} " + " ".join(f"{k} {v:.4f}" for k, v in sorted(obj_ema.items()))
                + f" lr {lr:.2e} {time.time() - t0:8.1f}s")
        step += 1
        if step < args.steps and (step % args.save_every == 0 or time.time() - last_save > 60 * args.save_minutes):
            checkpoint(step, "partial", do_eval=args.eval_partial)
            last_save = time.time()
    say(f"step {step:6d} loss {ema:.4f} (end of schedule) {time.time() - t0:8.1f}s")
    checkpoint(step, "final", do_eval=True)
    say(f"done in {time.time() - t0:.0f}s")


# ------------------------------------------------------------------------------------------------------- check
def recard(path, per_task):
    """Evaluate a written checkpoint with the reference decoder and rewrite its training_log.json and card (for a
    run stopped between checkpoints: its last checkpoint has no evaluation). `per_task` 0: keep the recorded
    evaluation, rewrite the card only."""
    st = json.load(open(os.path.join(path, "training_log.json")))
    family = st["family"]
    spec = dict(FAMILIES[family], objectives=st["objectives"], lr=st["lr"])
    spec.update({k: st[k] for k in ("blocks", "tasks", "ce_alpha", "tool_mix", "made_up", "city_weight", "precision")
                 if st.get(k) is not None})
    spec["blocks"] = {int(k): v for k, v in spec["blocks"].items()}   # JSON keys are strings
    model, ids = load_checkpoint(path, spec)
    spec.update(layers=model.config.num_hidden_layers, inter=model.config.intermediate_size)
    if per_task > 0:   # --eval-per-task 0: rewrite the card from the recorded evaluation
        st["eval"] = evaluate(model, family, spec, ids, per_task=per_task)
    if st["status"] == "partial" and st.get("minutes"):
        st["status"] = (f"partial: the run was stopped after this checkpoint, {st['train_seconds'] / 60:.0f} minutes "
                        f"into its {st['minutes']:g}-minute schedule (the learning rate had not decayed to 0)")
    json.dump(st, open(os.path.join(path, "training_log.json"), "w"), indent=1)
    write_card(path, family, spec, ids, st)
    print(json.dumps(st.get("eval", {}).get("results")))


def load_checkpoint(path, spec):
    """A written checkpoint in f32 through transformers' Qwen class; asserts no missing/unexpected weights."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    cls, ccls = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "qwen35": (Qwen3_5ForCausalLM, Qwen3_5TextConfig)}.get(
        spec["arch"], (Qwen2ForCausalLM, Qwen2Config))
    hf_cfg = ccls.from_dict({k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    model, info = cls.from_pretrained(path, config=hf_cfg, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    print(f"{path}: {cls.__name__} from_pretrained, loading info problems: {bad or 'none'}")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.config._attn_implementation = "sdpa"
    model.eval()
    return model, Ids(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), spec)


def check(path, per_task):
    """transformers loads the weights with no missing/unexpected keys; the reference decoder's held-out accuracy."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    arch = cfg["architectures"][0]
    family = {"DreamModel": "dream", "Fast_dLLM_QwenForCausalLM": "fast_dllm_v2", "Qwen3_5ForCausalLM": "qwen35",
              "SDARForCausalLM": "idlm"}.get(arch, "tiny")
    spec = FAMILIES[family]
    model, ids = load_checkpoint(path, spec)
    print(f"family {family}: mask id config={cfg.get('mask_token_id')} tokenizer({spec['mask_str']})={ids.mask}; "
          f"eos {cfg.get('eos_token_id')}; block {cfg.get('block_size', cfg.get('bd_size'))}")
    for task, p, a in held_out_set(1):
        if family == "idlm":
            text, n, f = ref_isd(model, ids, ids.encode(render(p)), spec["eval_block"] + 1)
        else:
            text, n, f = ref_generate(model, ids, spec["shift"], attention_of(family), ids.encode(render(p)), N=40,
                                      B=spec["eval_block"], tau=0.9)
        print(f"  {p!r} -> {text!r} ({'ok' if correct(task, p, a, text) else 'want ' + repr(a)}; {n} tokens, {f} forwards)")
    if per_task > 0:
        print(json.dumps(evaluate(model, family, spec, ids, per_task=per_task), indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES))
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=None, help="override the family's peak learning rate")
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall-time budget: the cosine schedule runs on max(step/steps, elapsed/budget) and training "
                         "stops when it reaches 1 (--steps is then an upper bound)")
    ap.add_argument("--objectives", help="override the family's objective mixture, e.g. dream:1,dream_prog:1")
    ap.add_argument("--blocks", help="override the family's block-size mixture, e.g. 1:1,2:1,4:2,8:1")
    ap.add_argument("--tasks", help="override the task mixture, e.g. sort:1,reverse:1,repeat:1,hello:1,add:1,count:1")
    ap.add_argument("--tool-mix", help="tools family: override the sample kinds' weights, e.g. call:2,result:2,bare:1")
    ap.add_argument("--made-up", type=float, default=None, help="tools family: the fraction of made-up city names in "
                    "training samples (default tool_tasks.MADE_UP, 0.4; evaluation keeps 0.4)")
    ap.add_argument("--city-weight", type=float, default=None, help="tools family: loss weight of the city's "
                    "characters in calls and results (default 1: every supervised token alike)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward (weights and optimiser stay "
                    "f32; about 2x faster a step on a recent x86 CPU's one thread)")
    ap.add_argument("--layers", type=int, help="override the family's layer count")
    ap.add_argument("--inter", type=int, help="override the family's MLP width")
    ap.add_argument("--ce-alpha", type=float, default=None, help="idlm: weight of the clean (AR) cross-entropy beside "
                    "the noisy one (I-DLM converts a trained AR model with 0.2; the twin learns AR from scratch: 1.0)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader processes building batches (GPU runs); 0: "
                    "built in the training process from one resumable random stream")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--save-minutes", type=float, default=10.0)
    ap.add_argument("--eval-partial", action="store_true", help="also evaluate at partial checkpoints")
    ap.add_argument("--eval-per-task", type=int, default=20)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init", metavar="DIR", help="start from the weights of a checkpoint written by this script (a "
                    "fresh optimiser and schedule: a warm restart); its card lists the earlier stages")
    ap.add_argument("--recard", metavar="DIR", help="evaluate a written checkpoint and rewrite its card")
    ap.add_argument("--check", metavar="DIR", help="only check a written checkpoint (HF load + reference decode)")
    args = ap.parse_args()
    if args.check or args.recard:
        torch.set_num_threads(args.threads)
        (check if args.check else recard)(args.check or args.recard, args.eval_per_task)
        return
    if not args.family or not args.out:
        ap.error("--family and --out are required for training")
    train(args)


if __name__ == "__main__":
    main()
