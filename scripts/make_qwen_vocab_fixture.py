"""Build a real Qwen2 tokenizer (151,643 byte-level BPE tokens + special tokens) and a small random-weight
Qwen2-architecture model that uses it, from the vocabulary GGUF that llama.cpp ships for its tokenizer tests.

Source: `llama.cpp/models/ggml-vocab-qwen2.gguf` (vocabulary only, no weights) with its golden tokenization
vectors `ggml-vocab-qwen2.gguf.inp` / `.out`, as vendored in the PyPI source distribution of llama-cpp-python:
    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d ~/.cache/mbd-rs
Needs numpy, safetensors and gguf (pip install gguf==0.19.0); nothing is fetched from a model hub.

    python scripts/make_qwen_vocab_fixture.py OUTDIR [--sdist PATH] [--no-model]

--sdist defaults to $MBD_LLAMACPP_SDIST. Writes (not committed: about 90 MB):
    OUTDIR/ggml-vocab-qwen2.gguf{,.inp,.out}   the three files, extracted from the sdist
    OUTDIR/tokenizer/                          tokenizer.json + tokenizer_config.json (ChatML chat template)
    OUTDIR/model/                              the same tokenizer files (+ a <|MASK|> token), config.json,
                                               generation_config.json, model.safetensors, scripted.json

The tokenizer.json is the Hugging Face form of the GGUF's vocabulary: a byte-level BPE model (vocab and merges
from the GGUF), Qwen2's pre-tokenizer (NFC normalizer, the split regex of Qwen2's tokenizer.json, byte-level
mapping without prefix space) and a ByteLevel decoder; the GGUF's control tokens (<|endoftext|>, <|im_start|>,
<|im_end|>) are added tokens marked special. The GGUF's `[PAD<n>]` entries (ids 151646..151935) are not
tokens: llama.cpp's converter invents them to fill the embedding matrix up to the model's vocab_size, and
Qwen's own tokenizer has no such entries, so they are left out here (config.json keeps vocab_size = 151936,
larger than the tokenizer, as real Qwen checkpoints do).

The model is a Qwen2ForCausalLM (hidden 64, 2 layers, GQA 4:2, untied head) read as a block-diffusion model:
config.json has `block_size` (block-causal attention) and `logits_shift: true`; its mask token is `<|MASK|>`,
an added special token right after the GGUF's vocabulary (config.json has no `mask_token_id`: the engine finds
the mask in the tokenizer). Its layers are random, but their outputs into the residual stream are scaled down
and the embedding and head carry a scripted bigram chain: after the token "\\n" (the last token of a ChatML
generation prompt) the model greedily writes SCRIPT_TEXT as a fixed token sequence, then <|im_end|>. That
sequence is chosen so that every multi-byte character of SCRIPT_TEXT is split across two or more tokens
(CJK, emoji, accented Latin), which is what a streaming detokenizer must get right; scripted.json records it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tarfile
import time
import unicodedata
from typing import Dict, List, Optional

import numpy as np

VOCAB_NAME = "ggml-vocab-qwen2.gguf"
SDIST_MEMBER_DIR = "vendor/llama.cpp/models/"
SDIST_ENV = "MBD_LLAMACPP_SDIST"

# Qwen2's pre-tokenization split, as in Qwen2's tokenizer.json (case-insensitive contractions, letters with one
# optional leading non-letter, single digits, punctuation runs with trailing newlines, newline runs, spaces).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A ChatML template in the style of Qwen2.5's instruct models (written for these tests): an optional leading
# system message (a default one otherwise), each message as <|im_start|>ROLE\nCONTENT<|im_end|>\n, and the
# generation prompt <|im_start|>assistant\n.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# A template in the shape of Qwen3's and SDAR's chat_template.jinja (written for these tests, not copied): no
# default system turn; the last user query found by walking messages backwards (namespace, messages[::-1]); an
# assistant turn's reasoning taken from `reasoning_content` or split out of "<think>...</think>" in its content and
# shown only after the last query; `enable_thinking=False` (a template argument) closes an empty think block in the
# generation prompt. Exercises the Python-style string methods (startswith, split, strip, lstrip, rstrip) and tests
# (`is string`, `is defined`, `is false`) that templates in the wild rely on.
QWEN3_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>')
        and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MASK_TOKEN = "<|MASK|>"
# What the scripted model writes after "\n": multi-byte characters of 2, 3 and 4 UTF-8 bytes, no newline.
SCRIPT_TEXT = "Grün ёж, 世界！東京 🦙🚀 ok"
SCRIPT_AFTER = "\n"  # the token the chain starts after (a ChatML generation prompt ends with it)
SCRIPT_END = "<|im_end|>"

# Model shape (Qwen2: q/k/v biases; untied head so that the embedding and head can carry the chain).
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, BLOCK = 64, 2, 4, 2, 128, 4
CHAIN_LOGIT = 24.0  # the scripted successor's logit; the other logits stay within about +-1


# --- the sdist and the GGUF ------------------------------------------------------------------------------------

def extract_vocab(sdist: str, outdir: str, name: str = VOCAB_NAME) -> Dict[str, str]:
    """Extract ggml-vocab-qwen2.gguf (or another vocabulary file `name` of llama.cpp's models/) and its .inp/.out
    from the llama-cpp-python sdist into outdir."""
    want = {name: None, name + ".inp": None, name + ".out": None}
    os.makedirs(outdir, exist_ok=True)
    with tarfile.open(sdist, "r:*") as tar:
        for m in tar:
            base = m.name.rsplit("/", 1)[-1]
            if base in want and m.name.endswith(SDIST_MEMBER_DIR + base) and m.isfile():
                src = tar.extractfile(m)
                assert src is not None
                dst = os.path.join(outdir, base)
                with open(dst, "wb") as f:
                    shutil.copyfileobj(src, f)
                want[base] = dst
                if all(want.values()):
                    break
    missing = [k for k, v in want.items() if v is None]
    if missing:
        raise SystemExit(f"{sdist}: no {SDIST_MEMBER_DIR}{', '.join(missing)} in this archive")
    return {k: v for k, v in want.items() if v is not None}


def tokenizer_fields(path: str) -> dict:
    """A GGUF's `tokenizer.*` metadata, read with the gguf package. Parsing a real vocabulary's ~150k strings takes
    the gguf package ~10 s, so the fields are kept as JSON in $XDG_CACHE_HOME/mbd-rs/vocab (~/.cache when unset),
    keyed by the file's SHA-256 and the gguf package's version: a later run reads them in a fraction of a second."""
    import hashlib
    from importlib.metadata import version

    import gguf

    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:32]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mbd-rs", "vocab")
    kept = os.path.join(cache, f"{digest}-gguf{version('gguf')}.json")
    try:
        with open(kept, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    r = gguf.GGUFReader(path)
    out = {k: r.fields[k].contents() for k in r.fields if k.startswith("tokenizer.")}
    try:
        os.makedirs(cache, exist_ok=True)
        tmp = f"{kept}.{os.getpid()}.tmp"  # written whole, then renamed: parallel test workers never read half
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f)
        os.replace(tmp, kept)
    except OSError:
        pass  # a read-only cache only costs the next run the parse
    return out


def read_vocab_gguf(path: str) -> dict:
    """The tokenizer fields of a vocabulary GGUF (`tokenizer_fields`) that this fixture uses, checked."""
    fields = tokenizer_fields(path)

    def field(name: str, default=None):
        return fields.get(name, default)

    out = {
        "model": field("tokenizer.ggml.model"),
        "pre": field("tokenizer.ggml.pre"),
        "tokens": list(field("tokenizer.ggml.tokens")),
        "token_type": [int(t) for t in field("tokenizer.ggml.token_type")],
        "merges": list(field("tokenizer.ggml.merges")),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "padding_token_id": field("tokenizer.ggml.padding_token_id"),
    }
    if out["model"] != "gpt2" or out["pre"] != "qwen2":
        raise SystemExit(f"{path}: expected a byte-level BPE ('gpt2') vocabulary with the 'qwen2' pre-tokenizer, "
                         f"found model={out['model']!r} pre={out['pre']!r}")
    if len(out["tokens"]) != len(out["token_type"]):
        raise SystemExit(f"{path}: {len(out['tokens'])} tokens but {len(out['token_type'])} token types")
    return out


# llama.cpp's token types (llama_token_type / gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
PAD_PLACEHOLDER = re.compile(r"\[PAD\d+\]")


def added_token(i: int, content: str, special: bool = True) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def build_tokenizer_json(v: dict, extra_special: Optional[List[str]] = None) -> dict:
    """The Hugging Face tokenizer.json of the GGUF vocabulary (+ extra special tokens appended after it)."""
    tokens, types = v["tokens"], v["token_type"]
    vocab: Dict[str, int] = {}
    added: List[dict] = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == NORMAL:
            if added or len(vocab) != i:
                raise SystemExit(f"token {i} {t!r} is a normal token after non-normal ones: not a Qwen2 layout")
            vocab[t] = i
        elif ty == CONTROL:
            added.append(added_token(i, t, special=True))
        elif ty == USER_DEFINED and PAD_PLACEHOLDER.fullmatch(t):
            pass  # embedding-matrix padding invented by llama.cpp's converter, not a token (see the docstring)
        else:
            raise SystemExit(f"token {i} {t!r} has token type {ty}, which this converter does not handle")
    if len(vocab) != len(set(vocab)):
        raise SystemExit("duplicate tokens in the vocabulary")
    next_id = max([a["id"] for a in added] + [len(vocab) - 1]) + 1
    for s in extra_special or []:
        added.append(added_token(next_id, s, special=True))
        next_id += 1
    merges = []
    for m in v["merges"]:
        pair = m.split(" ")
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise SystemExit(f"merge {m!r} is not a pair of vocabulary tokens whose join is a token")
        merges.append(pair)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def build_tokenizer_config(tok: dict, eos_token: str, pad_token: str) -> dict:
    specials = [a for a in tok["added_tokens"] if a["special"]]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in a if k != "id"} for a in specials},
        "additional_special_tokens": [a["content"] for a in specials if a["content"] not in (eos_token, pad_token)],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(v: dict, outdir: str, extra_special: Optional[List[str]] = None) -> dict:
    os.makedirs(outdir, exist_ok=True)
    tok = build_tokenizer_json(v, extra_special)
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    pad = v["tokens"][v["padding_token_id"]] if v["padding_token_id"] is not None else "<|endoftext|>"
    # The GGUF's eos (<|endoftext|>) ends a base model's documents; a ChatML model ends its turns with <|im_end|>.
    eos = "<|im_end|>" if "<|im_end|>" in ids else v["tokens"][v["eos_token_id"]]
    with open(os.path.join(outdir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(outdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(build_tokenizer_config(tok, eos, pad), f, ensure_ascii=False, indent=1)
    return tok


# --- byte-level BPE helpers (GPT-2's reversible byte <-> printable character mapping) ----------------------------

def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100...
    in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def token_str(b: bytes) -> str:
    return "".join(BYTE_TO_CHAR[x] for x in b)


def token_bytes(t: str) -> bytes:
    return bytes(CHAR_TO_BYTE[c] for c in t)


def split_chain(text: str, vocab: Dict[str, int], avoid: set) -> List[int]:
    """A sequence of distinct vocabulary tokens (none in `avoid`) whose bytes join to `text`, in which no token
    holds a whole multi-byte character (each one is split across tokens). Longest tokens first, backtracking."""
    data = text.encode("utf-8")
    # [start, end) byte spans of the multi-byte characters
    spans, pos = [], 0
    for ch in text:
        n = len(ch.encode("utf-8"))
        if n > 1:
            spans.append((pos, pos + n))
        pos += n
    used: set = set()

    def ok(i: int, j: int) -> bool:
        return not any(i <= a and b <= j for a, b in spans)

    def go(i: int) -> Optional[List[int]]:
        if i == len(data):
            return []
        for j in range(min(len(data), i + 16), i, -1):
            tid = vocab.get(token_str(data[i:j]))
            if tid is None or tid in used or tid in avoid or not ok(i, j):
                continue
            used.add(tid)
            rest = go(j)
            if rest is not None:
                return [tid] + rest
            used.discard(tid)
        return None

    chain = go(0)
    if chain is None:
        raise SystemExit(f"cannot split {text!r} into distinct tokens that cut every multi-byte character")
    return chain


# --- the model ---------------------------------------------------------------------------------------------------

def write_model(v: dict, outdir: str, seed: int = 0) -> dict:
    """A random-weight Qwen2 block-diffusion model with this tokenizer (+ <|MASK|>) and the scripted chain."""
    tok = write_tokenizer(v, outdir, extra_special=[MASK_TOKEN])
    vocab = tok["model"]["vocab"]
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    V, H, FF = len(v["tokens"]), HIDDEN, INTERMEDIATE  # the GGUF's embedding size (151936), as Qwen's configs
    D = H // HEADS
    assert max(ids.values()) < V
    after = vocab[token_str(SCRIPT_AFTER.encode())]
    end = ids[SCRIPT_END]
    assert unicodedata.normalize("NFC", SCRIPT_TEXT) == SCRIPT_TEXT and "\n" not in SCRIPT_TEXT
    chain = split_chain(SCRIPT_TEXT, vocab, avoid={after})
    assert len(chain) + 1 <= H, "one embedding direction per chain link"

    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * (scale / np.sqrt(shape[-1]))).astype(np.float32)

    # Embedding: random rows; the chain's predecessors ("\n", chain[0..-1]) get orthogonal one-hot rows so that
    # after the final RMSNorm (weight 1) position p carries sqrt(H) * e_k for link k; the mask token's row is 0.
    emb = rng.standard_normal((V, H), dtype=np.float32)
    head = w(V, H, scale=0.1)  # other logits: about N(0, 0.1^2 * H) = within +-1
    prev = [after] + chain
    succ = chain + [end]
    for k, (a, b) in enumerate(zip(prev, succ)):
        emb[a] = 0.0
        emb[a, k] = 1.0
        head[b] = 0.0
        head[b, k] = CHAIN_LOGIT / np.sqrt(H)
    emb[ids[MASK_TOKEN]] = 0.0
    t = {"model.embed_tokens.weight": emb, "lm_head.weight": head, "model.norm.weight": np.ones(H, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        t[f"{p}.self_attn.q_proj.weight"] = w(HEADS * D, H)
        t[f"{p}.self_attn.q_proj.bias"] = (0.1 * rng.standard_normal(HEADS * D)).astype(np.float32)
        t[f"{p}.self_attn.k_proj.weight"] = w(KV_HEADS * D, H)
        t[f"{p}.self_attn.k_proj.bias"] = (0.1 * rng.standard_normal(KV_HEADS * D)).astype(np.float32)
        t[f"{p}.self_attn.v_proj.weight"] = w(KV_HEADS * D, H)
        t[f"{p}.self_attn.v_proj.bias"] = (0.1 * rng.standard_normal(KV_HEADS * D)).astype(np.float32)
        # what the layers add to the residual stream is small next to the embedding (|x| ~ 1 per coordinate)
        t[f"{p}.self_attn.o_proj.weight"] = w(H, HEADS * D, scale=0.01)
        t[f"{p}.mlp.gate_proj.weight"] = w(FF, H)
        t[f"{p}.mlp.up_proj.weight"] = w(FF, H)
        t[f"{p}.mlp.down_proj.weight"] = w(H, FF, scale=0.01)
    from safetensors.numpy import save_file

    save_file(t, os.path.join(outdir, "model.safetensors"), metadata={"format": "pt"})
    eos_ids = [ids["<|im_end|>"], v["eos_token_id"]]
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": FF,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": LAYERS,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": V,
        "bos_token_id": v["bos_token_id"],
        "eos_token_id": eos_ids,
        "pad_token_id": v["padding_token_id"],
        # block diffusion: block-causal attention over blocks of BLOCK, the logit at i-1 predicts token i
        "block_size": BLOCK,
        "logits_shift": True,
    }
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(outdir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": v["bos_token_id"], "eos_token_id": eos_ids,
                   "pad_token_id": v["padding_token_id"], "do_sample": False}, f, indent=1)
    scripted = {"after_token_id": after, "text": SCRIPT_TEXT, "token_ids": chain, "end_token_id": end,
                "mask_token_id": ids[MASK_TOKEN]}
    with open(os.path.join(outdir, "scripted.json"), "w", encoding="utf-8") as f:
        json.dump(scripted, f, ensure_ascii=False, indent=1)
    return scripted


def build(outdir: str, sdist: str, model: bool = True) -> Dict[str, str]:
    """Extract the vocabulary, write OUTDIR/tokenizer and (with model) OUTDIR/model; returns their paths."""
    files = extract_vocab(sdist, outdir)
    v = read_vocab_gguf(files[VOCAB_NAME])
    paths = dict(files, tokenizer=os.path.join(outdir, "tokenizer"))
    write_tokenizer(v, paths["tokenizer"])
    if model:
        paths["model"] = os.path.join(outdir, "model")
        write_model(v, paths["model"])
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--sdist", default=os.environ.get(SDIST_ENV),
                    help=f"llama-cpp-python's sdist (.tar.gz); default ${SDIST_ENV}")
    ap.add_argument("--no-model", action="store_true", help="only the tokenizer")
    a = ap.parse_args()
    if not a.sdist:
        ap.error(f"no sdist: pass --sdist or set {SDIST_ENV}")
    t0 = time.time()
    paths = build(a.outdir, a.sdist, model=not a.no_model)
    for k, p in paths.items():
        print(f"{k}: {p}")
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
