"""The same question under three ways of decoding: autoregressive (one token per forward), multi-block diffusion
(several blocks in flight, confident tokens committed in parallel) and S2D2 self-speculation (drafts verified by the
same model at block size 1). The answers agree; the forwards they take do not. Tokens per forward counts the answer's
tokens: autoregressive decoding shows just under 1 because its last forward writes the end of text, which is not a
token of the answer.

    python examples/decoding_modes.py [model]
"""
import sys

from mbd_rs import Engine

eng = Engine.load(sys.argv[1] if len(sys.argv) > 1 else None)
messages = [{"role": "user", "content": "sort 5 3 8 1 9 2"}]
modes = {
    "autoregressive": dict(block_size=1),
    "multi-block diffusion": dict(block_size=8, threshold=0.5),
    "S2D2 self-speculation": dict(block_size=8, threshold=0.5, speculative="s2d2"),
}
for name, params in modes.items():
    out = eng.chat(messages, max_tokens=32, **params)
    print(f"{name:24s} {out.text!r:22s} {out.usage.forward_passes:3d} forwards, "
          f"{out.usage.tokens_per_forward:.1f} tokens/forward" + (" (the last forward writes the end of text, not "
                                                                  "a token)" if params["block_size"] == 1 else ""))
