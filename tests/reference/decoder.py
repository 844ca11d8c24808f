"""Reference multi-block decoder, written from the specification in docs/decoding.md (issue #3), not
from the Rust code: whole-sequence recompute each step with HF transformers and an explicit 4-D mask,
entropy in float64. Greedy only (temperature 0). Used to record fixtures and, where torch is installed,
to compare live.
"""
import math

import numpy as np


def block_of(p, attention, b, alignment, lp):
    if attention == "causal":
        return p
    if attention == "full":
        return 0
    if alignment == "absolute":
        return p // b
    return 0 if p < lp else 1 + (p - lp) // b


def gen_blocks(lp, n, b, attention, alignment):
    """Generation blocks as [start, end) absolute ranges."""
    blocks, s, end = [], lp, lp + n
    while s < end:
        if attention == "block_causal" and alignment == "absolute":
            e = (s // b + 1) * b
        else:
            e = s + b
        blocks.append([s, min(e, end)])
        s = min(e, end)
    return blocks


def attention_mask(total, attention, b, alignment, lp, torch):
    blk = [block_of(p, attention, b, alignment, lp) for p in range(total)]
    bq = torch.tensor(blk)
    m = torch.where(bq[None, :] <= bq[:, None], 0.0, torch.finfo(torch.float32).min)
    return m[None, None]


def reference_decode(model, prompt, *, n, mask_id, block_size, attention, alignment, logits_shift, threshold,
                     acceptance, alpha, beta, forced, early_stop, eos_ids, max_forward_passes=10000):
    import torch

    lp = len(prompt)
    x = list(prompt) + [mask_id] * n
    is_mask = [False] * lp + [True] * n
    blocks = gen_blocks(lp, n, block_size, attention, alignment)
    created = [False] * len(blocks)
    fully = [False] * len(blocks)
    created[0] = fully[0] = True
    eos_filled = False
    nfe = 0

    def progress(k):
        s, e = blocks[k]
        return sum(1 for p in range(s, e) if not is_mask[p]) / (e - s)

    def complete(k):
        s, e = blocks[k]
        return all(not is_mask[p] for p in range(s, e))

    while True:
        # 1. EOS fill
        if early_stop:
            found = [p for p in range(lp, lp + n) if not is_mask[p] and x[p] in eos_ids]
            if found:
                e = found[0]
                eos_filled = True
                for p in range(e + 1, lp + n):
                    x[p] = x[e]
                    is_mask[p] = False
        # 2. stop
        if not any(is_mask[lp:lp + n]):
            break
        # 3. activation
        for k in range(1, len(blocks)):
            if created[k] and progress(k - 1) >= beta:
                fully[k] = True
        # 4. add a block
        nc = sum(created)
        if nc < len(blocks) and not eos_filled:
            last = nc - 1
            if progress(last) >= alpha or complete(last):
                created[nc] = True
                fully[nc] = progress(last) >= beta
        # 5. forward: whole sequence, recomputed
        total = lp + n
        with torch.no_grad():
            logits = model(torch.tensor([x]), attention_mask=attention_mask(total, attention, block_size, alignment, lp, torch)).logits[0]
        logits = logits.double().numpy()
        nfe += 1
        # 6. predictions for masked positions of created blocks
        cand = [p for k in range(len(blocks)) if created[k] for p in range(*blocks[k]) if is_mask[p]]
        pred = {}
        for p in cand:
            row = logits[p - 1] if logits_shift else logits[p]
            z = row - row.max()
            prob = np.exp(z) / np.exp(z).sum()
            h = float(-(prob * np.log(np.maximum(prob, 1e-300))).sum())
            pred[p] = (int(np.argmax(row)), h, float(prob.max()))
        # 7. acceptance
        acc = set()
        if acceptance == "entropy":
            acc = {p for p in cand if pred[p][1] < threshold}
        elif acceptance == "confidence":
            acc = {p for p in cand if pred[p][2] > threshold}
        else:  # eb, per block
            for k in range(len(blocks)):
                ps = sorted((p for p in cand if blocks[k][0] <= p < blocks[k][1]), key=lambda p: (pred[p][1], p))
                total_h = 0.0
                for p in ps:
                    if total_h <= threshold:
                        acc.add(p)
                        total_h += pred[p][1]
                    else:
                        break
        # 8. forced progress
        fa = [k for k in range(len(blocks)) if created[k] and fully[k] and not complete(k)]
        if forced == "first":
            fa = fa[:1]
        for k in fa:
            ps = [p for p in cand if blocks[k][0] <= p < blocks[k][1]]
            if not any(p in acc for p in ps):
                acc.add(min(ps, key=lambda p: (pred[p][1], p)))
        # 9. write
        for p in acc:
            x[p] = pred[p][0]
            is_mask[p] = False
        if nfe >= max_forward_passes:
            break
    gen = [None if is_mask[p] else x[p] for p in range(lp, lp + n)]
    return gen, nfe


def completion_tokens(gen, eos_ids):
    """Stable prefix up to (excluding) the first EOS."""
    out = []
    for t in gen:
        if t is None or t in eos_ids:
            break
        out.append(t)
    return out
