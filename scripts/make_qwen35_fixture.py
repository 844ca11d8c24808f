"""Record greedy multi-block decoding on the trained Qwen3.5 hybrid twin (models/mbd-qwen35-tiny) with
the reference decoder (tests/reference/decoder.py `reference_decode`, HF transformers' Qwen3_5ForCausalLM in float32,
the block mask on the softmax layers, the Gated DeltaNet layers causal), for tests/test_trained_twins.py to hold the
engine to: the same tokens and the same forward count, cache on and off. On random weights a window rarely commits
more than its forced token; a trained model commits runs, fills blocks early and stops at its EOS, so it walks the
recurrent state's commit path through blocks of every fill. Developer tool (needs torch + transformers, see
scripts/make_parity_fixtures.py for the install line):
    /tmp/devenv/bin/python scripts/make_qwen35_fixture.py [--model DIR]
Writes tests/fixtures/decode/qwen35_twin.json.
"""
import json
import os
import sys

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "training"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from make_decode_fixtures import HybridMasks  # noqa: E402
from reference.decoder import completion_tokens, reference_decode  # noqa: E402
from tasks import V1_TASKS, held_out, render  # noqa: E402
from train import FAMILIES, load_checkpoint  # noqa: E402

PER_TASK = 3
MAX_TOKENS = 40
BASE = dict(attention="block_causal", alignment="absolute", logits_shift=False, alpha=0.1, beta=0.95, forced="first",
            early_stop=True)
# the decoding modes the twin serves (a recurrent state takes no approximate cache and no unshifted S2D2)
VARIANTS = {
    "entropy_b8_multiblock": dict(block_size=8, acceptance="entropy", threshold=0.5),
    "confidence_b8_single_block": dict(block_size=8, acceptance="confidence", threshold=0.9, alpha=1.0),
    "entropy_b4_every": dict(block_size=4, acceptance="entropy", threshold=0.3, forced="every"),
    "sub_block_b8_4": dict(block_size=8, acceptance="confidence", threshold=0.9, alpha=1.0, sub_block=4),
    "dus_b8": dict(block_size=8, acceptance="dus", threshold=None, alpha=1.0),
    "ar": dict(block_size=1, acceptance="confidence", threshold=1.0, alpha=1.0),
}


def main():
    model_dir = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else os.path.join(ROOT, "models",
                                                                                                   "mbd-qwen35-tiny")
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    model, ids = load_checkpoint(model_dir, FAMILIES["qwen35"])
    model = HybridMasks(model)
    eos = list(cfg["eos_token_id"])
    cases = []
    for task in V1_TASKS:
        for prompt, _ in held_out(task, PER_TASK):
            pr = ids.encode(render(prompt))
            for vname, v in VARIANTS.items():
                p = {**BASE, **v}
                gen, nfe = reference_decode(model, pr, n=MAX_TOKENS, mask_id=cfg["mask_token_id"], eos_ids=eos, **p)
                toks = completion_tokens(gen, eos)
                cases.append(dict(task=task, prompt=prompt, prompt_ids=pr, variant=vname, params=p, tokens=toks,
                                  forward_passes=nfe, text=ids.tok.decode(toks)))
    out = dict(model="models/mbd-qwen35-tiny", max_tokens=MAX_TOKENS, eos_token_ids=eos,
               recorded_with=f"transformers {transformers.__version__}, torch {torch.__version__}, float32, "
                             "tests/reference/decoder.py reference_decode", cases=cases)
    path = os.path.join(ROOT, "tests", "fixtures", "decode", "qwen35_twin.json")
    json.dump(out, open(path, "w"), indent=0)
    tpf = {v: sum(len(c["tokens"]) for c in cases if c["variant"] == v) /
           sum(c["forward_passes"] for c in cases if c["variant"] == v) for v in VARIANTS}
    print(f"{path}: {len(cases)} cases; tokens per forward: " + ", ".join(f"{k} {t:.2f}" for k, t in tpf.items()))


if __name__ == "__main__":
    main()
