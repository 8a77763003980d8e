#!/usr/bin/env bash
# Runs every check and test of roccl. Works on a fresh machine with the Rust toolchain:
# installs the few Debian packages it needs (gcc/g++ for the C ABI tests, pkg-config).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step says when it began (minutes:seconds since the start), so a slow step shows.
step() { printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v python3 >/dev/null || need+=(python3)
# The `verbs` feature (RoCE v2 NICs through rdma-sys) needs libibverbs and bindgen's libclang
# to build; the default build needs none of them.
# The `hip` feature (AMD GPUs through hip-sys) links libamdhip64 (Debian: HIP 5.2; HIP_PATH=/usr).
for p in libibverbs-dev librdmacm-dev libclang-dev libamdhip64-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  step "installing ${need[*]}"
  (apt-get install -y "${need[@]}" >/dev/null 2>&1 || (apt-get update >/dev/null && apt-get install -y "${need[@]}" >/dev/null))
fi

step "format"
cargo fmt --all -- --check
step "shell scripts: no pipe into 'grep -q' (under pipefail it fails at random; scripts/lint-shell.sh)"
scripts/lint-shell.sh
step "the default build needs no libibverbs (rdma-sys only with --features verbs)"
if cargo tree -p roccl -e normal --prefix none 2>/dev/null | grep '^rdma-sys' >/dev/null; then
  echo "the default build depends on rdma-sys"
  exit 1
fi
export HIP_PATH=${HIP_PATH:-/usr}
features=roccl/verbs,roccl/hip,roccl/cuda
step "clippy (default build, and with the verbs, hip and cuda features)"
cargo clippy --workspace --all-targets --release -- -D warnings
cargo clippy --workspace --all-targets --release --features "$features" -- -D warnings
step "layers: names under src/ point only down; no cycle runs between top-level modules, nor between the files of one folder (tests/layers.rs)"
cargo test --release --workspace --features "$features" --test layers
step "tests (ranks as threads and as processes; built with the verbs, hip and cuda features)"
# Tests that need RDMA hardware or a GPU are skipped with a message; none are counted as passes.
cargo test --release --workspace --features "$features" --lib --bins --tests -- --test-threads 2
step "the failure tests again beside a busy core (yes > /dev/null): a slow rank is not a dead one, and blame must hold on a loaded machine"
yes >/dev/null &
busy=$!
status=0
cargo test --release --workspace --features "$features" --test failures -- --test-threads 2 || status=$?
kill "$busy"
[ "$status" -eq 0 ] || exit "$status"
if [ -n "${ROCCL_TEST_IB_DEVICE:-}" ]; then
  step "hardware: the collective suite over the RoCE v2 NIC $ROCCL_TEST_IB_DEVICE"
  cargo test --release --features verbs --test verbs -- --ignored --test-threads 1
else
  step "hardware tests SKIPPED: ROCCL_TEST_IB_DEVICE is not set (no RDMA NIC here);" \
    "the collective suite over a RoCE v2 NIC (tests/verbs.rs, 3 tests) did not run on a NIC"
fi
step "the NIC suite on Linux soft-RoCE (rdma_rxe) in qemu VMs, and the engine against it (tests/rxe/run.sh, about 9 min; ROCCL_SKIP_RXE=1 skips it)"
FEATURES="$features" tests/rxe/run.sh
if [ -e /dev/kfd ] || [ -e /proc/driver/nvidia ]; then
  step "a GPU is present: the HIP/CUDA open tests above opened it; run scripts/gpu-check.sh for collectives on its buffers"
else
  step "GPU tests SKIPPED: no GPU here (HIP and CUDA were checked to report 'no device');" \
    "stream-ordered collectives ran on the simulated device only"
fi
step "fuzz targets, 10 s each on the kept corpus (scripts/fuzz.sh; longer: scripts/fuzz.sh SECONDS)"
scripts/fuzz.sh 10
step "benches (each run once, as a smoke test)"
cargo test --release --benches
step "C ABI: header vs symbols, C and C++ programs, example (with the target directory given as an absolute path, as a user's CARGO_TARGET_DIR may be)"
CARGO_TARGET_DIR="$(scripts/target-dir)" tests/c/run.sh
step "NCCL/RCCL network plugin: every exported version, driven as NCCL's proxy does (target directory absolute, too)"
CARGO_TARGET_DIR="$(scripts/target-dir)" tests/plugin/run.sh
step "NCCL-named library (libroccl-nccl.so), called through ctypes as vLLM's pynccl does"
cargo build --release -p roccl-nccl
release="$(scripts/target-dir)/release"
python3 tests/nccl/test_pynccl.py "$release/libroccl_nccl.so" 3
ROCCL_NET=tcp python3 tests/nccl/test_pynccl.py "$release/libroccl_nccl.so" 2
python3 tests/nccl/test_pynccl.py "$release/libroccl_nccl.so" 3 --streams
step "NCCL 2.32's real nccl.h: a C program compiled against it links against libroccl-nccl.so alone"
tests/nccl/header/run.sh "$release"
step "vLLM 0.33's pynccl use of libroccl-nccl.so, CUDA and ROCm platform rules (tests/nccl/test_vllm.py)"
python3 tests/nccl/test_vllm.py "$release/libroccl_nccl.so" 3
step "ncclSetEncryption: encrypted ranks over TCP, the wire captured on lo (no plaintext), a wrong key refused"
python3 tests/nccl/test_encryption.py "$release/libroccl_nccl.so"
step "ncclCommShrink after a rank is killed, ncclCommGrow with a new process, ncclCommRevoke (tests/nccl/test_shrink.py)"
python3 tests/nccl/test_shrink.py "$release/libroccl_nccl.so"
step "torch.distributed backend: torch from PyPI (cached), pip install ./ffi/torch, pytest over 2-4 processes"
ffi/torch/tests/run.sh
step "stream-ordered collectives and roccl-perf on device-only buffers of the simulated device (scripts/gpu-check.sh sim)"
gpu_out=$(scripts/gpu-check.sh sim 3 262144)
# Both sections (the C ABI program and roccl-perf --device sim) report no wrong result.
[ "$(grep -c "# wrong results: 0" <<<"$gpu_out")" = 2 ] || { echo "$gpu_out"; exit 1; }
step "install from a copy of the source into a clean target directory, and pkg-config"
# The copy has no target/ and builds into a target directory of its own, so install.sh must
# build everything it installs and cannot pass on what the steps above built (about 2 min).
work=$(mktemp -d)
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard |
  tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$work/src"
tmp="$work/prefix"
(cd "$work/src" && CARGO_TARGET_DIR="$work/target" scripts/install.sh --prefix "$tmp" >/dev/null)
rm -rf "$work/target" "$work/src"
PKG_CONFIG_PATH="$tmp/lib/pkgconfig" pkg-config --exists roccl
test -x "$tmp/lib/libnccl-net-roccl.so" && test -x "$tmp/lib/librccl-net-roccl.so"
test -x "$tmp/lib/libroccl-nccl.so"
python3 tests/nccl/test_pynccl.py "$tmp/lib/nccl-compat/libnccl.so.2" 2
# shellcheck disable=SC2046
gcc -std=c11 -D_POSIX_C_SOURCE=200809L examples/allreduce.c -o "$tmp/example" $(PKG_CONFIG_PATH="$tmp/lib/pkgconfig" pkg-config --cflags --libs roccl)
ROCCL_SOCKET_IFNAME=lo "$tmp/example" 2 | grep "on 2 ranks: ok" >/dev/null
"$tmp/bin/roccl-perf" --ranks 2 -b 8 -e 1K --iters 2 --warmup 1 | grep "# wrong results: 0" >/dev/null
rm -rf "$work"
step "RoCE v2 and TCP across network namespaces (hosts of several ranks, a switchless mesh, two rails, networks chosen per peer and size), and a decoded capture"
tests/netns/run.sh
tests/netns/mesh.sh
tests/netns/rails.sh
tests/netns/choice.sh
tests/capture/run.sh
step "docs"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet -p roccl --features verbs,hip,cuda
step "all checks passed"
