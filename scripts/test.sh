#!/usr/bin/env bash
# Build the extension and run every test: Rust unit tests, then pytest.
# Uses the active virtualenv, or creates ./.venv. Set CARGO_TARGET_DIR to share a Rust build dir.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  . .venv/bin/activate
fi
python -m pip install -q --disable-pip-version-check "maturin>=1.16,<2" "pytest>=8" "numpy>=1.24" "safetensors>=0.4"
# Optional extras used by tests when present (server tests) are installed by their own issue.
maturin develop -q
cargo test -q -p mbd-core
python -m pytest -q tests "$@"
