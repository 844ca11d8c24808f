"""Quantized weights: the matrices quantized at load into GGUF block formats (q8_0, q6_k, q4_k, ...), about a
quarter to a seventh of the float32 bytes; `info` says what is held. GGUF files load the same way
(`Engine.load("model.gguf")`).

    python examples/quantize.py [model]
"""
import sys

from mbd_rs import Engine

path = sys.argv[1] if len(sys.argv) > 1 else None
messages = [{"role": "user", "content": "reverse a b c d"}]
for quantize in (None, "q8_0", "q4_k"):
    eng = Engine.load(path, quantize=quantize)
    i = eng.info
    print(f"{str(quantize):5s} {i.weight_format:8s} {i.weight_bytes / 2**20:6.2f} MiB  "
          f"int8 activations: {i.int8_activations!s:5s} -> {eng.chat(messages, max_tokens=16).text}")
