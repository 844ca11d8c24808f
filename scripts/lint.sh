#!/usr/bin/env bash
# Lint the Rust code: rustfmt --check and clippy with warnings as errors (CI runs this before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
