"""Record greedy decoding fixtures with the reference decoder (tests/reference/decoder.py) over HF
transformers, on the parity checkpoints. Developer tool (needs torch + transformers, see
scripts/make_parity_fixtures.py for the install line). Run from the repository root:
    /tmp/devenv/bin/python scripts/make_decode_fixtures.py [--only PREFIX,...]
--only re-records just the variants whose names start with one of the prefixes and merges them into the existing
cases.json (the other cases and prompt_logprobs.json are kept as they are).
Writes tests/fixtures/decode/cases.json (per case: tokens, forward passes, finish reason, and each completion
token's log-probability under the forward that decided it, with that forward's 3 most likely ids), and
tests/fixtures/decode/prompt_logprobs.json (left-to-right scores of whole sequences, by definition).
"""
import json
import os
import sys

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from reference.decoder import attention_mask, completion_tokens, reference_decode  # noqa: E402

PARITY = os.path.join(ROOT, "tests", "fixtures", "parity")
OUT = os.path.join(ROOT, "tests", "fixtures", "decode")
MASK_ID = 3


class HybridMasks:
    """transformers' Qwen3.5 takes a 4-D mask per layer type: the block mask goes to the softmax-attention layers,
    the Gated DeltaNet layers get none (they stay causal: Open-dLLM's multi-block generation runs them so)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask=None, **kw):
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = {"full_attention": attention_mask, "linear_attention": None}
        return self.model(input_ids, attention_mask=attention_mask, **kw)


def load(name):
    cfg = json.load(open(os.path.join(PARITY, name, "config.json")))
    cls = getattr(transformers, cfg["architectures"][0])
    model = cls.from_pretrained(os.path.join(PARITY, name), attn_implementation="eager").eval()
    return HybridMasks(model) if "layer_types" in cfg else model


def applies(name, v):
    """Whether a variant applies to a model: a hybrid's recurrent layers take no approximate cache (it refreshes and
    splices positions) and no unshifted S2D2 verification (two rows per position)."""
    if name not in HYBRID:
        return True
    return not v.get("cache") and not (v.get("s2d2") and not v.get("logits_shift"))


MODELS = ["qwen3_headdim_gqa", "qwen2_gqa_tied", "qwen3moe_top2_norm", "qwen35_hybrid"]
HYBRID = {"qwen35_hybrid"}


def entropy_quantiles(model, prompt, n, b):
    x = list(prompt) + [MASK_ID] * n
    with torch.no_grad():
        lg = model(torch.tensor([x]), attention_mask=attention_mask(len(x), "block_causal", b, "absolute", len(prompt), torch)).logits[0].double()
    p = torch.softmax(lg[len(prompt):], -1)
    h = -(p * torch.log(p)).sum(-1).numpy()
    mp = p.max(-1).values.numpy()
    return np.quantile(h, [0.25, 0.5, 0.75]), np.quantile(mp, [0.25, 0.5, 0.75])


def prompt_scores(model, ids, shift):
    """Each token's left-to-right log-probability by its definition, one transformers forward per position
    (causal attention): shifted, the row of the previous position over ids; unshifted, the last row of
    ids[:i] + [mask] (a mask at i that sees the tokens before it and itself). Returns (logprobs, top-3 ids), None
    for the first token."""
    lps, tops = [None], [None]
    with torch.no_grad():
        if shift:
            full = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        for i in range(1, len(ids)):
            if shift:
                row = full[i - 1]
            else:
                row = torch.log_softmax(model(torch.tensor([ids[:i] + [MASK_ID]])).logits[0, -1].double(), -1)
            lps.append(round(float(row[ids[i]]), 7))
            tops.append(sorted(range(row.shape[0]), key=lambda t: (-float(row[t]), t))[:3])
    return lps, tops


def tccf_tokens(name, model, prompt, n, eos_ids, p):
    """TCCF's trigger and check text for a case: the trigger is a token this run produces early (one whose text
    tokenizes back to it alone), the check text a short string; both as text (what a caller passes) and ids."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(PARITY, name, "tokenizer.json"))
    plain, _ = reference_decode(model, prompt, n=n, mask_id=MASK_ID, eos_ids=eos_ids,
                                **{k: v for k, v in p.items() if k != "tccf"})
    for t in plain[2:]:
        text = tok.decode([t]) if t is not None else ""
        if t is not None and t not in eos_ids and t != MASK_ID and tok.encode(text, add_special_tokens=False).ids == [t]:
            break
    else:
        return None  # this run makes no token whose text is that token alone
    check_text = " check it"
    return dict(p["tccf"], trigger=t, trigger_text=text, check_text=check_text,
                check=tok.encode(check_text, add_special_tokens=False).ids)


def PREFIX(delay, refresh=None, window=None):
    return dict(mode="prefix", delay=delay, refresh=refresh, window=window)


def S2D2(policy, **kw):
    return dict(dict(policy=policy, min_span=8, score_threshold=0.0, penalty=1.0, penalty_kind="static",
                     hysteresis=[1.0, -5.0]), **kw)


BASE = dict(block_size=4, attention="block_causal", alignment="absolute", logits_shift=False, acceptance="entropy",
            alpha=0.1, beta=0.95, forced="first", early_stop=True)


def main():
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    # --models A,B: record those models' cases alone and merge them in (the other models' cases are kept)
    models = sys.argv[sys.argv.index("--models") + 1].split(",") if "--models" in sys.argv else None
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(0)
    cases = []
    for name in MODELS:
        model = load(name)
        for lp in (6, 8):
            prompt = [int(t) for t in rng.integers(4, 300, lp)]
            if models and name not in models:
                continue
            n = 19
            hq, pq = entropy_quantiles(model, prompt, n, 4)
            h50 = round(float(hq[1]), 3)
            # An EOS id that the model does produce: the middle token of an EOS-free greedy run.
            probe, _ = reference_decode(model, prompt, n=n, mask_id=MASK_ID, threshold=h50, eos_ids=[],
                                        **{**BASE, "early_stop": False})
            eos = int(probe[n // 2])
            variants = {
                "entropy_q50": dict(threshold=h50),
                "entropy_q25_every": dict(threshold=round(float(hq[0]), 3), forced="every"),
                "entropy_q75_alpha05_beta05": dict(threshold=round(float(hq[2]), 3), alpha=0.5, beta=0.5),
                "entropy_alpha0": dict(threshold=h50, alpha=0.0, beta=0.3),
                "prompt_grid_b5": dict(threshold=h50, alignment="prompt", block_size=5),
                "shifted": dict(threshold=h50, logits_shift=True),
                "shifted_prompt_grid": dict(threshold=h50, logits_shift=True, alignment="prompt", block_size=3),
                "confidence_q50": dict(acceptance="confidence", threshold=round(float(pq[1]), 3)),
                "eb": dict(acceptance="eb", threshold=round(float(hq[1]) * 1.5, 3)),
                "single_block": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0),
                "ar_b1": dict(block_size=1, alpha=1.0, threshold=h50),
                "eos_fill": dict(threshold=h50, eos=[0, eos]),
                "eos_no_early_stop": dict(threshold=h50, eos=[0, eos], early_stop=False),
                "eos_every_shifted": dict(threshold=h50, eos=[0, eos], forced="every", logits_shift=True),
                "full_attention": dict(attention="full", threshold=h50, logits_shift=True, block_size=5),
                "causal_attention": dict(attention="causal", threshold=h50, logits_shift=True, block_size=4),
                # Fast-dLLM v2 sub-blocks: unshifted, and shifted with the block-start step
                "sub_block": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0,
                                  block_size=8, sub_block=4),
                "fast_dllm_v2": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0,
                                     block_size=8, sub_block=4, logits_shift=True),
                # S2D2 self-speculative verification
                "s2d2_always": dict(threshold=h50, alpha=1.0, s2d2=S2D2("always")),
                "s2d2_always_multiblock": dict(threshold=h50, s2d2=S2D2("always")),
                "s2d2_min_span": dict(threshold=h50, alpha=1.0, s2d2=S2D2("min_span", min_span=2)),
                "s2d2_score": dict(threshold=h50, alpha=1.0, s2d2=S2D2("score")),
                "s2d2_score_dynamic_b8": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0,
                                              block_size=8, s2d2=S2D2("score", penalty_kind="dynamic")),
                "s2d2_hysteresis_multiblock": dict(threshold=h50, s2d2=S2D2("hysteresis", penalty_kind="dynamic")),
                "s2d2_shifted_always": dict(threshold=h50, alpha=1.0, logits_shift=True, s2d2=S2D2("always")),
                "s2d2_fast_dllm_v2": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0,
                                          block_size=8, sub_block=4, logits_shift=True,
                                          s2d2=S2D2("hysteresis", penalty_kind="dynamic")),
                # d3LLM's approximate prefix cache for full attention
                "prefix_d1": dict(attention="full", threshold=h50, logits_shift=True, block_size=5,
                                  cache=PREFIX(1)),
                "prefix_d0_unshifted": dict(attention="full", threshold=h50, block_size=4, cache=PREFIX(0)),
                "prefix_d2_refresh3": dict(attention="full", threshold=h50, logits_shift=True, block_size=4,
                                           cache=PREFIX(2, 3)),
                "prefix_d1_single_block_eos": dict(attention="full", threshold=h50, logits_shift=True, block_size=4,
                                                   alpha=1.0, eos=[0, eos], cache=PREFIX(1)),
                "prefix_d1_created": dict(attention="full", threshold=h50, logits_shift=True, block_size=4,
                                          cache=PREFIX(1, window="created")),
                "prefix_d2_refresh3_created_unshifted": dict(attention="full", threshold=h50, block_size=5,
                                                             cache=PREFIX(2, 3, window="created")),
                # Fast-dLLM v1's dual cache for full attention
                "dual": dict(attention="full", threshold=h50, logits_shift=True, block_size=4, cache=dict(mode="dual")),
                "dual_single_block_unshifted": dict(attention="full", threshold=h50, block_size=4, alpha=1.0,
                                                    cache=dict(mode="dual")),
                "dual_b5_eos": dict(attention="full", threshold=h50, logits_shift=True, block_size=5, eos=[0, eos],
                                    cache=dict(mode="dual")),
                "s2d2_prompt_grid_eos": dict(threshold=h50, alignment="prompt", block_size=5, eos=[0, eos],
                                             s2d2=S2D2("score", score_threshold=0.5)),
                # the acceptance rules of 2026: TDAR's BACD (bounds from this model's confidence quantiles), dInfer's
                # CreditDecoding, DUS's dilated schedule
                "bacd_single_block": dict(acceptance="bacd", threshold=None, alpha=1.0, block_size=8,
                                          bacd=(round(float(pq[0]), 3), round(float(pq[2]), 3))),
                "bacd_multiblock_every": dict(acceptance="bacd", threshold=None, forced="every",
                                              bacd=(round(float(pq[0]), 3), round(float(pq[1]), 3))),
                "bacd_shifted_eos": dict(acceptance="bacd", threshold=None, alpha=1.0, logits_shift=True,
                                         eos=[0, eos], bacd=(round(float(pq[0]), 3), round(float(pq[2]), 3))),
                "credit_single_block": dict(acceptance="credit", threshold=round(float(pq[2]), 3), alpha=1.0,
                                            block_size=8, credit=dict(alpha=0.7, gamma=0.2, beta=0.8)),
                "credit_strong_multiblock": dict(acceptance="credit", threshold=round(float(pq[2]), 3),
                                                 credit=dict(alpha=4.0, gamma=0.5, beta=0.5)),
                "credit_shifted_eos": dict(acceptance="credit", threshold=round(float(pq[1]), 3), alpha=1.0,
                                           logits_shift=True, eos=[0, eos], credit=dict(alpha=2.0, gamma=0.2, beta=0.8)),
                "dus_single_block_b8": dict(acceptance="dus", threshold=None, alpha=1.0, block_size=8),
                "dus_multiblock_b4": dict(acceptance="dus", threshold=None),
                "dus_prompt_grid_b6_shifted": dict(acceptance="dus", threshold=None, alignment="prompt", block_size=6,
                                                   logits_shift=True, alpha=0.5, beta=0.5),
                # TDAR's TCCF: think in blocks of 4 until a trigger token the model produces, then the
                # check text and the answer in blocks of 1 or 2
                "tccf_b1_multiblock": dict(threshold=h50, eos=[0, eos], tccf=dict(answer_block=1)),
                "tccf_b2_single_block": dict(acceptance="confidence", threshold=round(float(pq[1]), 3), alpha=1.0,
                                             tccf=dict(answer_block=2)),
                "tccf_b1_shifted_no_early_stop": dict(threshold=h50, logits_shift=True, early_stop=False,
                                                      tccf=dict(answer_block=1)),
                "tccf_b3_prompt_grid": dict(threshold=h50, alignment="prompt", block_size=5, tccf=dict(answer_block=3)),
                # credit is the block's: positions laid out in other blocks by the switch start afresh
                "tccf_credit_b2": dict(acceptance="credit", threshold=round(float(pq[2]), 3), block_size=8,
                                       credit=dict(alpha=2.0, gamma=0.2, beta=0.8), tccf=dict(answer_block=2)),
            }
            for vname, v in variants.items():
                if only and not any(vname.startswith(o) for o in only):
                    continue
                if not applies(name, v):
                    continue
                p = {**BASE, **v}
                eos_ids = p.pop("eos", [0])
                if p.get("tccf"):
                    p["tccf"] = tccf_tokens(name, model, prompt, n, eos_ids, p)
                    if p["tccf"] is None:
                        print(f"{name} lp={lp} {vname}: no trigger candidate, skipped")
                        continue
                lps = {}
                gen, nfe = reference_decode(model, prompt, n=n, mask_id=MASK_ID, eos_ids=eos_ids, logprobs=lps, **p)
                comp = completion_tokens(gen, eos_ids)
                # the completion's tokens, and the EOS that ended it (when one did)
                ended = len(comp) < n and gen[len(comp)] in eos_ids
                # (TCCF writes a check text that no forward decided: no log-probabilities there)
                lp_comp = [] if p.get("tccf") else [lps[lp + i] for i in range(len(comp) + int(ended))]
                finish = "stop" if any(t in eos_ids for t in gen if t is not None) else "length"
                cases.append(dict(model=name, variant=vname, prompt=prompt, max_tokens=n, mask_token_id=MASK_ID,
                                  eos_token_ids=eos_ids, params=p, generated=gen, completion=comp,
                                  forward_passes=nfe, finish_reason=finish,
                                  completion_logprobs=[round(v, 7) for v, _ in lp_comp],
                                  completion_top3=[t for _, t in lp_comp]))
                switched = ""
                if p.get("tccf"):
                    ck = p["tccf"]["check"]
                    switched = " switched" if any(gen[i:i + len(ck)] == ck for i in range(n)) else " NOT SWITCHED"
                print(f"{name} lp={lp} {vname:28s} nfe={nfe:2d} tokens={len(comp):2d} tpf={len(comp) / nfe:.2f} {finish}"
                      + switched)
    if only or models:
        old = json.load(open(os.path.join(OUT, "cases.json")))["cases"]
        redone = lambda c: ((not only or any(c["variant"].startswith(o) for o in only))
                            and (not models or c["model"] in models))
        kept = [c for c in old if not redone(c)]
        json.dump({"cases": kept + cases}, open(os.path.join(OUT, "cases.json"), "w"), indent=0)
        return
    json.dump({"cases": cases}, open(os.path.join(OUT, "cases.json"), "w"), indent=0)
    # Prompt scoring (Engine.prompt_logprobs): one sequence longer than the engine's scoring chunk (128)
    scores = []
    for name, length in [("qwen3_headdim_gqa", 150), ("qwen2_gqa_tied", 12), ("qwen3moe_top2_norm", 12)]:
        model = load(name)
        ids = [int(t) for t in rng.integers(4, 300, length)]
        for shift in (False, True):
            lps, tops = prompt_scores(model, ids, shift)
            scores.append(dict(model=name, ids=ids, logits_shift=shift, logprobs=lps, top3=tops))
            print(f"prompt scores {name} shift={shift} len={length}")
    json.dump({"scores": scores}, open(os.path.join(OUT, "prompt_logprobs.json"), "w"), indent=0)


if __name__ == "__main__":
    main()
