#!/usr/bin/env bash
# Build roccl in release mode and install what exists so far under --prefix DIR:
#   bin/roccl-perf
# (lib/ and include/ follow once the C ABI exists.)
set -euo pipefail
prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --prefix=*) prefix="${1#--prefix=}"; shift ;;
    -h|--help) echo "usage: scripts/install.sh --prefix DIR"; exit 0 ;;
    *) echo "install.sh: unknown argument '$1' (usage: scripts/install.sh --prefix DIR)" >&2; exit 2 ;;
  esac
done
[ -n "$prefix" ] || { echo "install.sh: --prefix DIR is required" >&2; exit 2; }
cd "$(dirname "$0")/.."
cargo build --release --bin roccl-perf
install -d "$prefix/bin"
install -m 0755 target/release/roccl-perf "$prefix/bin/roccl-perf"
echo "installed $prefix/bin/roccl-perf"
