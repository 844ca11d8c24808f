#!/usr/bin/env bash
# Lint the Rust code: the floor plan (imports only downward, no circles, every file in a wing: scripts/check_layers.py
# reads docs/architecture.md's `layers` block), rustfmt --check and clippy with warnings as errors (CI runs this
# before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== floor plan (scripts/check_layers.py)"
python3 scripts/check_layers.py
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
