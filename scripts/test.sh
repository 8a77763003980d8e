#!/usr/bin/env bash
# Runs every check and test of roccl. Usable on a fresh machine: needs only the Rust
# toolchain (apt packages are installed here once later networks need them).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== format"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --all-targets --release -- -D warnings
echo "== tests (ranks as threads and as processes)"
# Tests that need RDMA hardware or a GPU are skipped with a message; none are counted as passes.
cargo test --release --lib --bins --tests -- --test-threads 2
echo "== benches (each run once, as a smoke test)"
cargo test --release --benches
echo "== docs"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
echo "== all checks passed"
