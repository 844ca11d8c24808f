#!/usr/bin/env bash
# Build the extension once (debug) and run the tests: Rust tests, mypy --strict on the package and the README's
# Python examples, then pytest on up to 4 worker processes (pytest-xdist; MBD_TEST_WORKERS=N sets how many, 0 runs in
# this process; skip reasons listed at the end). `--all` also runs the tests marked slow (real-shape
# checkpoints), the client libraries (LiteLLM, langchain-openai) and Ray Serve in venvs of their own (CI does); other
# arguments go to pytest.
# (The Rust lints, rustfmt and clippy, are scripts/lint.sh; CI runs both.)
# Always in its own ./.venv (a user's install, e.g. a release `pip install .`, is never replaced by this debug
# build). Set CARGO_TARGET_DIR to share a Rust build dir. On a 2-core machine the first run takes 10-15 minutes and
# ~2 GB of disk (the Rust build ~1.2 GB, the venv ~0.5 GB; --all adds ~1 GB), later runs ~2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then all=1; else args+=("$a"); fi
done
start=$(date +%s)
stage() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
# a line every 30 s while a step runs that can be silent longer (cargo prints nothing while one big crate compiles)
heartbeat() {
  (while sleep 30; do echo "   ... still working ($(( $(date +%s) - start )) s)"; done) &
  local hb=$! rc=0
  # the heartbeat's pid is expanded now, on purpose: `hb` is local to this function
  # shellcheck disable=SC2064
  trap "kill $hb 2>/dev/null" EXIT
  "$@" || rc=$?
  kill "$hb" 2>/dev/null; wait "$hb" 2>/dev/null || true
  trap - EXIT
  return "$rc"
}
stage "python test environment (./.venv: maturin, pytest, transformers, ...)"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
# pip shows one line per package it collects or installs (a first run's progress), nothing when all is there
pip_install() {
  python -m pip install --disable-pip-version-check --progress-bar off "$@" \
    | { grep -v -e "^Requirement already satisfied" -e "^Looking in links" || true; }
}
pip_install maturin==1.16.0 -r scripts/test-requirements.txt
# tests/test_qwen_vocab.py: Qwen2's real 151k-token vocabulary, from the vocabulary GGUF llama.cpp ships for its
# tokenizer tests (in llama-cpp-python's 77 MB sdist, downloaded once into the cache; skipped, saying so, without it).
pip_install gguf==0.19.0 tokenizers==0.23.3 transformers==5.23.0 jinja2==3.1.6
export MBD_LLAMACPP_SDIST="${XDG_CACHE_HOME:-$HOME/.cache}/mbd-rs/llama_cpp_python-0.3.36.tar.gz"
[ -f "$MBD_LLAMACPP_SDIST" ] || python -m pip download -q --disable-pip-version-check --no-deps \
  --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "${MBD_LLAMACPP_SDIST%/*}" \
  || echo "the llama-cpp-python sdist could not be downloaded: tests/test_qwen_vocab.py will be skipped"
stage "build (debug extension into ./.venv; the first build compiles ~300 crates)"
heartbeat maturin develop
stage "cargo test"
# the whole workspace, so that the dependencies resolve with the features the extension's build gave them (numpy and
# pyo3 turn on features of num-complex and syn): `-p mbd-core` alone would compile every dependency a second time
heartbeat cargo test --workspace -- -q
stage "mypy --strict (package + README examples)"
bash scripts/check_types.sh
workers=${MBD_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); echo $(( n < 4 ? n : 4 )))}
stage "pytest ($workers workers)"
if [ "$all" = 1 ]; then
  python -m pytest -q -rs -n "$workers" tests ${args[@]+"${args[@]}"}
else
  python -m pytest -q -rs -n "$workers" -m "not slow" tests ${args[@]+"${args[@]}"}
fi
if [ "$all" != 1 ]; then
  stage "done (bash scripts/test.sh --all also runs the slow tests and the client-library and Ray Serve tests, as CI does)"
  exit 0
fi
stage "pytest tests/test_clients.py (LiteLLM, langchain-openai; their own venv, the extension built above)"
[ -x .venv-clients/bin/python ] || python3 -m venv .venv-clients
.venv-clients/bin/python -m pip install -q --disable-pip-version-check -r scripts/client-requirements.txt
PYTHONPATH=python .venv-clients/bin/python -m pytest -q -p no:cacheprovider tests/test_clients.py
stage "pytest tests/test_ray.py (Ray Serve scale-out: a local Ray cluster, 2 replicas; its own venv)"
[ -x .venv-ray/bin/python ] || python3 -m venv .venv-ray
.venv-ray/bin/python -m pip install -q --disable-pip-version-check -r scripts/ray-requirements.txt
PYTHONPATH=python .venv-ray/bin/python -m pytest -q -p no:cacheprovider tests/test_ray.py
stage "done"
