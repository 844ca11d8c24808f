#!/usr/bin/env bash
# Build the extension once (debug) and run every test: Rust tests, mypy --strict on the package and the README's
# Python examples, then pytest. (The Rust lints, rustfmt and clippy, are scripts/lint.sh; CI runs both.)
# Always in its own ./.venv (a user's install, e.g. a release `pip install .`, is never replaced by this debug
# build). Set CARGO_TARGET_DIR to share a Rust build dir. On a 2-core machine the first run takes ~8 minutes,
# later runs ~1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check maturin==1.16.0 -r scripts/test-requirements.txt
# tests/test_qwen_vocab.py: Qwen2's real 151k-token vocabulary, from the vocabulary GGUF llama.cpp ships for its
# tokenizer tests (in llama-cpp-python's 77 MB sdist, downloaded once into the cache; skipped, saying so, without it).
python -m pip install -q --disable-pip-version-check gguf==0.19.0 tokenizers==0.23.3 transformers==5.23.0 jinja2==3.1.6
export MBD_LLAMACPP_SDIST="${XDG_CACHE_HOME:-$HOME/.cache}/mbd-rs/llama_cpp_python-0.3.36.tar.gz"
[ -f "$MBD_LLAMACPP_SDIST" ] || python -m pip download -q --disable-pip-version-check --no-deps \
  --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "${MBD_LLAMACPP_SDIST%/*}" \
  || echo "the llama-cpp-python sdist could not be downloaded: tests/test_qwen_vocab.py will be skipped"
echo "== build (debug extension into ./.venv)"
maturin develop
echo "== cargo test"
cargo test -q -p mbd-core
echo "== mypy --strict (package + README examples)"
bash scripts/check_types.sh
echo "== pytest"
python -m pytest -q tests "$@"
echo "== pytest tests/test_clients.py (LiteLLM, langchain-openai; their own venv, the extension built above)"
[ -x .venv-clients/bin/python ] || python3 -m venv .venv-clients
.venv-clients/bin/python -m pip install -q --disable-pip-version-check -r scripts/client-requirements.txt
PYTHONPATH=python .venv-clients/bin/python -m pytest -q -p no:cacheprovider tests/test_clients.py
echo "== pytest tests/test_ray.py (Ray Serve scale-out: a local Ray cluster, 2 replicas; its own venv)"
[ -x .venv-ray/bin/python ] || python3 -m venv .venv-ray
.venv-ray/bin/python -m pip install -q --disable-pip-version-check -r scripts/ray-requirements.txt
PYTHONPATH=python .venv-ray/bin/python -m pytest -q -p no:cacheprovider tests/test_ray.py
