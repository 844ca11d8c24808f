#!/usr/bin/env bash
# Build the extension and run every test: Rust unit tests, then pytest.
# Uses the active virtualenv, or creates ./.venv. Set CARGO_TARGET_DIR to share a Rust build dir.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  . .venv/bin/activate
fi
# Versions the suite was last run with (pinned for reproducibility; the package itself needs only numpy).
python -m pip install -q --disable-pip-version-check maturin==1.16.0 pytest==9.2.0 numpy==2.4.6 safetensors==0.8.0 \
  starlette==1.10.0 uvicorn==0.54.0 openai==3.54.0 httpx==0.28.1
maturin develop -q
cargo test -q -p mbd-core
python -m pytest -q tests "$@"
