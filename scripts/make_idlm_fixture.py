"""Record greedy ISD on the trained I-DLM twin (models/mbd-idlm-tiny) with the reference decoder
(tests/reference/decoder.py `reference_isd`, HF transformers in float32), for tests/test_trained_twins.py to hold the
engine to: the same tokens and the same forward count at every stride. On random weights no draft is ever accepted,
so only a trained model checks the acceptance walk (runs of accepted drafts, bonus tokens, rejections and cold
starts). Developer tool (needs torch + transformers, see scripts/make_parity_fixtures.py for the install line):
    /tmp/devenv/bin/python scripts/make_idlm_fixture.py
Writes tests/fixtures/decode/idlm_twin.json.
"""
import json
import os
import sys

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "training"))
from reference.decoder import completion_tokens, reference_isd  # noqa: E402
from tasks import V1_TASKS, held_out, render  # noqa: E402
from train import FAMILIES, load_checkpoint  # noqa: E402

MODEL = os.path.join(ROOT, "models", "mbd-idlm-tiny")
STRIDES = (1, 2, 3, 4, 8)
PER_TASK = 4
MAX_TOKENS = 40


def main():
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    # transformers' Qwen3 class reads SDARForCausalLM's weights (load_checkpoint asserts none missing or unexpected)
    model, ids = load_checkpoint(MODEL, FAMILIES["idlm"])
    eos = set(cfg["eos_token_id"])
    cases = []
    for task in V1_TASKS:
        for prompt, _ in held_out(task, PER_TASK):
            pr = ids.encode(render(prompt))
            for stride in STRIDES:
                gen, nfe = reference_isd(model, pr, n=MAX_TOKENS, mask_id=cfg["mask_token_id"], stride=stride,
                                         eos_ids=eos)
                cases.append(dict(task=task, prompt=prompt, prompt_ids=pr, stride=stride,
                                  tokens=completion_tokens(gen, eos), forward_passes=nfe))
    out = dict(model="models/mbd-idlm-tiny", max_tokens=MAX_TOKENS, recorded_with=f"transformers {transformers.__version__}, "
               f"torch {torch.__version__}, float32, tests/reference/decoder.py reference_isd", cases=cases)
    path = os.path.join(ROOT, "tests", "fixtures", "decode", "idlm_twin.json")
    json.dump(out, open(path, "w"), indent=0)
    accepted = sum(len(c["tokens"]) + 1 - c["forward_passes"] for c in cases if c["stride"] > 1)
    print(f"{path}: {len(cases)} cases; tokens written beyond one per forward at strides > 1: {accepted}")


if __name__ == "__main__":
    main()
