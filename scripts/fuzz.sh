#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ (cargo-fuzz, libFuzzer) for a bounded time on its kept
# corpus: scripts/fuzz.sh [seconds-per-target] (default 15). Installs cargo-fuzz if missing.
# New corpus entries go to a temporary copy (the repository stays clean); a crash, a
# timeout or a memory blow-up fails the run and prints the input's path (under
# fuzz/artifacts/<target>/): reproduce with `cargo fuzz run <target> <path>` in fuzz/ (with
# RUSTC_BOOTSTRAP=1 on a stable toolchain), then fix it, add the input to fuzz/corpus/<target>/
# and a unit test next to the code.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-15}
CARGO_FUZZ_VERSION=0.12.0
if ! cargo fuzz --version 2>/dev/null | grep "$CARGO_FUZZ_VERSION" >/dev/null; then
  echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --locked "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi
# cargo-fuzz passes nightly flags (-Z sanitizer): a stable toolchain accepts them with this.
export RUSTC_BOOTSTRAP=1
# AddressSanitizer catches a write past the memory the engine's regions cover; where the
# toolchain cannot link it, ROCCL_FUZZ_SANITIZER=none runs the targets without it.
san=${ROCCL_FUZZ_SANITIZER:-address}
# Leak checks are off: the C ABI target keeps one communicator for the whole run.
flags=(--sanitizer "$san" -O --debug-assertions)
echo "== building the fuzz targets (sanitizer: $san)"
cargo fuzz build "${flags[@]}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=()
for t in $(cargo fuzz list); do
  mkdir -p "$tmp/$t" "artifacts/$t"
  echo "== $t: ${secs}s"
  if [ -d "corpus/$t" ]; then
    cp -r "corpus/$t/." "$tmp/$t/"
  fi
  log="$tmp/$t.log"
  if cargo fuzz run "${flags[@]}" "$t" "$tmp/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -detect_leaks=0 \
      -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
    grep -E '^#[0-9]+ *DONE|stat::number_of_executed_units|cov:' "$log" | tail -2 || true
  else
    tail -60 "$log"
    art=$(grep -oE "artifacts/$t/[^ ]+" "$log" | tail -1 || true)
    echo "!! $t failed; input: fuzz/${art:-artifacts/$t/ (see the log above)}"
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing found crashes in: ${failed[*]}"
  exit 1
fi
echo "== fuzzing: no crashes"
