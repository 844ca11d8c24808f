"""Reference multi-block decoder, written from the specification in docs/decoding.md, not
from the Rust code: whole-sequence recompute each step with HF transformers and an explicit 4-D mask,
entropy in float64. Greedy only (temperature 0). Used to record fixtures and, where torch is installed,
to compare live.

Also the acceptance rules of 2026, from their authors' code as docs/decoding.md states them: TDAR's BACD
(a per-block threshold: the block's first step's max confidence, then the mean of its committed confidences,
clipped to bounds), dInfer's CreditDecoding (dense per-block credit tensors, decayed every step of the block after
its first, fused into the logits) and DUS (the dilated schedule, built here by the DUS authors' level loop); and
TDAR's TCCF as docs/decoding.md states it (think until the trigger, write the check text after the thinking, and
from the trigger's grid block on decode, and attend, in blocks of the answer's size).

Also I-DLM's introspective strided decoding (`reference_isd`), greedy, from the paper's description as
docs/decoding.md states it.

Also Fast-dLLM v2's sub-blocks and block-start step, and S2D2 verification, from the papers'
pseudo-code: the verifier is the same model at block size 1 (the 2L trick for unshifted models, a causal
forward for shifted ones), and positions committed through a verification keep causal K/V ("AR-like caching"),
so every forward here gives those positions causal visibility.
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


def block_end(p, attention, b, alignment, lp):
    """End (exclusive) of the block holding p: the keys [0, block_end) a grid row sees."""
    if attention == "causal":
        return p + 1
    if attention == "full":
        return 10 ** 9
    if alignment == "absolute":
        return (p // b + 1) * b
    return lp if p < lp else lp + ((p - lp) // b + 1) * b


def mask_from_ends(ends, extra=None, torch=None):
    """Additive 4-D mask from per-row visible key sets: row r sees keys [0, ends[r]) plus extra[r]."""
    n = len(ends)
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    for r, e in enumerate(ends):
        m[r, :min(e, n)] = 0.0
        for k in (extra or {}).get(r, ()):
            m[r, k] = 0.0
    return m[None, None]


def reference_decode(model, prompt, *, n, mask_id, block_size, attention, alignment, logits_shift, threshold,
                     acceptance, alpha, beta, forced, early_stop, eos_ids, max_forward_passes=10000,
                     sub_block=None, s2d2=None, cache=None, logprobs=None, bacd=None, credit=None, tccf=None):
    """logprobs: None, or a dict filled with position -> (log-probability of the token written there under the
    logits row of the forward that decided it (log-softmax, float64), the 3 most likely ids of that row).
    s2d2: None, or dict(policy=always|min_span|score|hysteresis, min_span=, score_threshold=, penalty=,
    penalty_kind=static|dynamic, hysteresis=(on, off)).
    cache: None (recompute every step), or for full attention dict(mode="prefix", delay=, refresh=, window=): d3LLM's
    approximate prefix cache (`_sample_multi_block_kv_cache`), or dict(mode="dual"): Fast-dLLM v1's dual cache
    over the active region (first incomplete created block .. end of the last created block), both kept in a
    transformers DynamicCache.
    bacd: (lower, upper) for acceptance="bacd"; credit: dict(alpha=, gamma=, beta=) for acceptance="credit".
    tccf: None, or dict(trigger=id, check=[ids], answer_block=B) (other keys ignored)."""
    import torch
    from transformers import DynamicCache

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

    def grid_origin(k):
        s = blocks[k][0]
        return s // block_size * block_size if attention == "block_causal" and alignment == "absolute" else s

    origins = [grid_origin(k) for k in range(len(blocks))]

    def origin(k):
        return origins[k]

    # TCCF: thinking ends at the trigger as at an EOS; after the switch, blocks of the answer's size from `switch_at`
    think_eos = list(eos_ids) + ([tccf["trigger"]] if tccf else [])
    final_eos = list(eos_ids)
    if tccf:
        eos_ids = think_eos
    switch_at = None

    def blk(p):
        if switch_at is not None and p >= switch_at:
            first = 0 if switch_at == 0 else block_of(switch_at - 1, attention, block_size, alignment, lp) + 1
            return first + (p - switch_at) // tccf["answer_block"]
        return block_of(p, attention, block_size, alignment, lp)

    # S2D2 state: positions with causal K/V, the end of the final K/V (the cache's length), hysteresis
    causal = set()
    frontier = (lp // block_size) * block_size if attention == "block_causal" and alignment == "absolute" else lp
    hyst_on = False
    # prefix cache state: the DynamicCache, its length, per schedule span (prompt, then created blocks) the step
    # it was first seen complete at and whether it is cached, and the logits row before the cache's end
    kv, kv_len, completed_at, cached, carry, dual_region = None, 0, {0: 0}, {}, None, None

    def keep_first(c, k):
        """Cut a DynamicCache to its first k positions (transformers 5 crops by a negative count)."""
        extra = c.get_seq_length() - k
        if extra > 0:
            c.crop(-extra)

    def row_end(p):
        return p + 1 if p in causal else block_end(p, attention, block_size, alignment, lp)

    def probs(row):
        z = row - row.max()
        pr = np.exp(z) / np.exp(z).sum()
        return pr, float(-(pr * np.log(np.maximum(pr, 1e-300))).sum())

    def log_softmax(row):
        z = row - row.max()
        return z - np.log(np.exp(z).sum())

    rows = {}  # position -> the logits row of this step's prediction (or the verifier's)

    def record(p):
        if logprobs is not None:
            ls = log_softmax(rows[p])
            top = sorted(range(len(ls)), key=lambda t: (-ls[t], t))[:3]
            logprobs[p] = (float(ls[x[p]]), top)

    bacd_hist = {}  # block -> confidences of its committed tokens
    credit_c, credit_steps = {}, {}  # block range -> {position: credit vector}, block range -> steps it has had

    def block_k(p):
        return next(k for k in range(len(blocks)) if blocks[k][0] <= p < blocks[k][1])

    def rule(cand, pred):
        acc = set()
        if acceptance in ("bacd", "credit", "dus"):
            for k in range(len(blocks)):
                ps = [p for p in cand if blocks[k][0] <= p < blocks[k][1]]
                if not ps:
                    continue
                if acceptance == "bacd":
                    lo, hi = bacd
                    h = bacd_hist.get(k)
                    tau = min(max(max(pred[p][2] for p in ps) if not h else sum(h) / len(h), lo), hi)
                    acc |= {p for p in ps if pred[p][2] >= tau}
                elif acceptance == "credit":
                    best = max(pred[p][2] for p in ps)
                    acc |= {p for p in ps if pred[p][2] >= min(threshold, best - 1e-5)}
                else:
                    for level in dus_levels(blocks[k][1] - origin(k)):
                        hit = [p for p in ps if p - origin(k) in level]
                        if hit:
                            acc |= set(hit)
                            break
            return acc
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
        return acc

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
        # candidates: masked positions of created blocks (with sub-blocks: each block's first sub-block with masks)
        cand = []
        for k in range(len(blocks)):
            if not created[k]:
                continue
            ms = [p for p in range(*blocks[k]) if is_mask[p]]
            if sub_block and ms:
                first_sub = (ms[0] - origin(k)) // sub_block
                ms = [p for p in ms if (p - origin(k)) // sub_block == first_sub]
            cand += ms
        # Fast-dLLM v2 block start (shifted, sub-blocks): a grid block's first token alone, from the previous
        # block's last logit
        ar_step = bool(sub_block and logits_shift and any(blocks[k][0] == origin(k) == cand[0] for k in range(len(blocks)))
                       and (cand[0] == lp or not is_mask[cand[0] - 1]))
        if ar_step:
            cand = cand[:1]
        # the K/V of complete created blocks from the frontier on are final now
        for k in range(len(blocks)):
            if blocks[k][1] <= frontier:
                continue
            if created[k] and complete(k):
                frontier = blocks[k][1]
            else:
                break
        # 5. forward: whole sequence, recomputed (or, with the prefix cache, from the cache's end)
        total = lp + n
        start = 0
        if cache and cache["mode"] == "dual":
            a = next(blocks[k][0] for k in range(len(blocks)) if created[k] and not complete(k))
            b = max(blocks[k][1] for k in range(len(blocks)) if created[k])
            with torch.no_grad():
                if kv is not None and dual_region == (a, b):
                    # the region alone, over the cached prefix and suffix
                    start = a
                    out = model(torch.tensor([x[a:b]]), past_key_values=kv, use_cache=True,
                                attention_mask=torch.zeros(1, 1, b - a, kv_len + b - a),
                                position_ids=torch.arange(a, b)[None])
                    keep_first(kv, kv_len)
                    logits = out.logits[0]
                else:
                    fresh = DynamicCache()
                    out = model(torch.tensor([x]), past_key_values=fresh, use_cache=True,
                                attention_mask=torch.zeros(1, 1, total, total))
                    logits = out.logits[0]
                    kv = DynamicCache()
                    for li, layer in enumerate(fresh.layers):
                        kv.update(torch.cat([layer.keys[:, :, :a], layer.keys[:, :, b:]], 2),
                                  torch.cat([layer.values[:, :, :a], layer.values[:, :, b:]], 2), li)
                    kv_len, dual_region = a + total - b, (a, b)
                    carry = logits[a - 1].double().numpy() if logits_shift else None
            logits = logits.double().numpy()
        elif cache:
            step = nfe + 1
            spans = [(0, lp)] + [tuple(blocks[k]) for k in range(len(blocks)) if created[k]]
            full_span = lambda sp: all(not is_mask[p] for p in range(max(sp[0], lp), sp[1]))  # noqa: E731
            to = None
            for i, sp in enumerate(spans):
                if sp[1] <= kv_len:
                    continue
                if not full_span(sp):
                    break
                completed_at.setdefault(i, step)
                if step - completed_at[i] >= cache["delay"] and not cached.get(i):
                    cached[i] = True
                    to = sp[1]
            waiting = any(i in completed_at and not cached.get(i) and full_span(sp) for i, sp in enumerate(spans))
            periodic = cache.get("refresh") and step % cache["refresh"] == 0
            zeros = lambda w, c: torch.zeros(1, 1, w, c + w)  # noqa: E731  (full attention)
            # forwards end at the canvas end (d3LLM), or with window="created" at the last created block's end
            end = max(b[1] for k, b in enumerate(blocks) if created[k]) if cache.get("window") == "created" else total
            with torch.no_grad():
                if to is not None or (kv_len > 0 and not waiting and not periodic):
                    start = kv_len
                    w = end - kv_len
                    if kv is None:
                        kv = DynamicCache()
                    out = model(torch.tensor([x[kv_len:end]]), past_key_values=kv, use_cache=True,
                                attention_mask=zeros(w, kv_len), position_ids=torch.arange(kv_len, end)[None])
                    keep = to if to is not None else kv_len
                    keep_first(kv, keep)
                    logits = out.logits[0]
                    if to is not None and logits_shift:
                        carry = logits[keep - 1 - start].double().numpy()
                    kv_len = keep
                else:
                    fresh = DynamicCache()
                    out = model(torch.tensor([x[:end]]), past_key_values=fresh, use_cache=True, attention_mask=zeros(end, 0))
                    logits = out.logits[0]
                    if kv_len > 0:
                        keep_first(fresh, kv_len)
                        kv = fresh
                        if logits_shift:
                            carry = logits[kv_len - 1].double().numpy()
            logits = logits.double().numpy()
        else:
            if causal:
                am = mask_from_ends([row_end(p) for p in range(total)], torch=torch)
            elif switch_at is not None:
                ids_ = torch.tensor([blk(p) for p in range(total)])
                am = torch.where(ids_[None, :] <= ids_[:, None], 0.0, torch.finfo(torch.float32).min)[None, None]
            else:
                am = attention_mask(total, attention, block_size, alignment, lp, torch)
            with torch.no_grad():
                logits = model(torch.tensor([x]), attention_mask=am).logits[0]
            logits = logits.double().numpy()
        nfe += 1
        # 6. predictions for the candidates
        pred = {}
        if acceptance == "credit":  # credit is keyed by the block's range, as dInfer keys it
            for k in {tuple(blocks[block_k(p)]) for p in cand}:
                if credit_steps.get(k, 0) > 0:
                    for vec in credit_c[k].values():
                        vec *= credit["beta"]
                credit_steps[k] = credit_steps.get(k, 0) + 1
        for p in cand:
            if logits_shift:
                row = logits[p - 1 - start] if p - 1 >= start else carry
            else:
                row = logits[p - start]
            rows[p] = row
            if acceptance == "credit":
                pr, _ = probs(row)
                vec = credit_c.setdefault(tuple(blocks[block_k(p)]), {}).setdefault(p, np.zeros(len(row)))
                vec[int(np.argmax(row))] += float(pr.max()) ** credit["gamma"]
                row = row + credit["alpha"] * np.log1p(vec)
            pr, h = probs(row)
            pred[p] = (int(np.argmax(row)), h, float(pr.max()))
        # S2D2: verify the span (first run of consecutive candidates, in one block)?
        verified = None
        if s2d2 and not ar_step and nfe + 1 <= max_forward_passes:
            k0 = next(k for k in range(len(blocks)) if blocks[k][0] <= cand[0] < blocks[k][1])
            span = [cand[0]]
            while len(span) < len(cand) and cand[len(span)] == span[-1] + 1 and cand[len(span)] < blocks[k0][1]:
                span.append(cand[len(span)])
            conf = len([p for p in rule(cand, pred) if blocks[k0][0] <= p < blocks[k0][1]])
            prod, ek = 1.0, 0.0
            for p in span:
                prod *= min(1.0, math.exp(-pred[p][1] / math.log(logits.shape[1])))
                ek += prod
            score = ek - s2d2["penalty"] * (conf if s2d2["penalty_kind"] == "dynamic" else 1)
            pol = s2d2["policy"]
            if pol == "always":
                do = True
            elif pol == "min_span":
                do = len(span) >= s2d2["min_span"]
            elif pol == "score":
                do = score >= s2d2["score_threshold"]
            else:
                on, off = s2d2["hysteresis"]
                hyst_on = score >= off if hyst_on else score > on
                do = hyst_on
            if do:
                s0, e0 = span[0], span[-1] + 1
                xv = x[:e0]
                for p in span:
                    xv = xv[:p] + [pred[p][0]] + xv[p + 1:]
                ends = [row_end(p) if p < frontier else p + 1 for p in range(e0)]
                ids, pos, extra = list(xv), list(range(e0)), {}
                if not logits_shift:  # the 2L trick: one mask row per span position at the same position
                    for j, i in enumerate(span):
                        ids.append(mask_id)
                        pos.append(i)
                        ends.append(i)
                        extra[e0 + j] = [e0 + j]
                am = mask_from_ends(ends, extra, torch=torch)
                with torch.no_grad():
                    vl = model(torch.tensor([ids]), attention_mask=am,
                               position_ids=torch.tensor([pos])).logits[0].double().numpy()
                nfe += 1
                qrows = [vl[i - 1] if logits_shift else vl[e0 + j] for j, i in enumerate(span)]
                q = [int(np.argmax(r)) for r in qrows]
                acc_n = 0
                while acc_n < len(span) and q[acc_n] == pred[span[acc_n]][0]:
                    acc_n += 1
                verified = {span[j]: pred[span[j]][0] for j in range(acc_n)}
                if acc_n < len(span):
                    verified[span[acc_n]] = q[acc_n]
                rows.update({span[j]: qrows[j] for j in range(len(span))})  # the verifier decided these
                # the first half's K/V up to the first rejection are final, and causal
                causal.update(range(frontier, s0 + acc_n))
                frontier = max(frontier, s0 + acc_n)
        if verified is not None:
            for p, t in verified.items():
                x[p] = t
                is_mask[p] = False
                record(p)
            if nfe >= max_forward_passes:
                break
            continue
        # 7. acceptance
        acc = set(cand) if ar_step else rule(cand, pred)
        # 8. forced progress: the most confident position by the rule's own score
        fa = [k for k in range(len(blocks)) if created[k] and fully[k] and not complete(k)]
        if forced == "first":
            fa = fa[:1]
        for k in fa:
            ps = [p for p in cand if blocks[k][0] <= p < blocks[k][1]]
            if ps and not any(p in acc for p in ps):
                if acceptance in ("confidence", "bacd", "credit"):
                    acc.add(min(ps, key=lambda p: (-pred[p][2], p)))
                else:
                    acc.add(min(ps, key=lambda p: (pred[p][1], p)))
        # 9. write
        for p in acc:
            if acceptance == "bacd":
                bacd_hist.setdefault(block_k(p), []).append(pred[p][2])
            x[p] = pred[p][0]
            is_mask[p] = False
            record(p)
        # TCCF: the first end-of-text is the trigger and everything before it is decoded: switch
        if tccf and switch_at is None and nfe < max_forward_passes:
            ends = [p for p in range(lp, lp + n) if not is_mask[p] and x[p] in eos_ids]
            e = ends[0] if ends else None
            if e is not None and x[e] == tccf["trigger"] and not any(is_mask[lp:e]):
                k = block_k(e)
                switch_at, s0, end = origin(k), blocks[k][0], lp + n
                c = min(len(tccf["check"]), end - e)
                for i, p in enumerate(range(e, end)):
                    x[p], is_mask[p] = (tccf["check"][i], False) if i < c else (mask_id, True)
                answer, ba = e + c, tccf["answer_block"]
                blocks, origins, created, fully = blocks[:k], origins[:k], created[:k], fully[:k]
                while s0 < end:
                    o = switch_at + (s0 - switch_at) // ba * ba
                    blocks.append([s0, min(o + ba, end)])
                    origins.append(o)
                    created.append(s0 <= answer)
                    fully.append(s0 <= answer)
                    s0 = blocks[-1][1]
                bacd_hist = {kk: v for kk, v in bacd_hist.items() if kk < k}
                eos_ids, eos_filled = final_eos, False
        if nfe >= max_forward_passes:
            break
    gen = [None if is_mask[p] else x[p] for p in range(lp, lp + n)]
    return gen, nfe


def dus_levels(b, a=2, skip=1):
    """The DUS authors' dilated schedule of a block of b positions (offsets): strides b // a**skip, then divided by
    a down to 1, each level the offsets divisible by the stride not revealed yet; leftovers form a last level, and
    a last level smaller than the one before is merged into it."""
    levels, revealed = [], set()
    stride = b // a ** skip
    while stride >= 1:
        level = [o for o in range(b) if o % stride == 0 and o not in revealed]
        if level:
            levels.append(level)
            revealed |= set(level)
        stride //= a
    rest = [o for o in range(b) if o not in revealed]
    if rest:
        levels.append(rest)
    if len(levels) >= 2 and len(levels[-1]) < len(levels[-2]):
        levels[-2] = sorted(levels[-2] + levels.pop())
    return levels


def reference_isd(model, prompt, *, n, mask_id, stride, eos_ids, early_stop=True):
    """I-DLM's introspective strided decoding (arXiv 2604.11035), greedy, as docs/decoding.md states it, the whole
    sequence recomputed causally every forward (the model's own causal mask: no mask argument). A step forwards
    [.., pending, d_1 .. d_s, M x m] (pending: the last written token, before the first step the prompt's last;
    m = min(stride - 1, room - s - 1) masks, room = positions left of the n). The rows of pending and the drafts
    verify: drafts are taken while each equals its row's argmax, the first that does not is replaced by that argmax
    and this step's drafts are dropped (the next step is a cold start); with every draft taken, the last verifier
    row gives one more token (when room is left) and the mask rows' argmax are the next drafts. stride 1 is AR.
    Returns (written tokens, forwards); with early_stop the steps end once an EOS is written."""
    import torch

    dev = next(model.parameters()).device
    x, drafts, gen, nfe = list(prompt), [], [], 0
    while len(gen) < n and not (early_stop and any(t in eos_ids for t in gen)):
        room = n - len(gen)
        drafts = drafts[:room]
        s = len(drafts)
        m = min(stride - 1, max(0, room - s - 1))
        with torch.no_grad():
            logits = model(torch.tensor([x + drafts + [mask_id] * m], device=dev)).logits[0]
        nfe += 1
        best = logits[len(x) - 1:].float().argmax(-1).tolist()
        k = 0
        while k < s and drafts[k] == best[k]:
            k += 1
        new = drafts[:k]
        if k < s:
            new.append(best[k])
            drafts = []
        else:
            if s < room:
                new.append(best[s])
            drafts = best[s + 1:s + 1 + m]
        x += new[:room]
        gen += new[:room]
    return gen, nfe


def completion_tokens(gen, eos_ids):
    """Stable prefix up to (excluding) the first EOS."""
    out = []
    for t in gen:
        if t is None or t in eos_ids:
            break
        out.append(t)
    return out
