#!/usr/bin/env bash
# On a machine with a GPU: build roccl with the GPU runtime, run stream-ordered collectives
# on device buffers through the C ABI (ranks as threads sharing the GPU), then roccl-perf on
# device buffers (ranks as processes sharing the GPU); every result checked, short tables;
# then graph capture (an all-reduce and a broadcast captured in global mode, replayed with
# new inputs) and NCCL's NULL stream on device memory (examples/gpu_capture.rs).
# Not part of CI, which runs the same programs on the simulated device.
#   scripts/gpu-check.sh [cuda|hip|sim] [RANKS] [MAX_BYTES]
# Default runtime: cuda when an NVIDIA driver is present, hip when /dev/kfd exists.
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(scripts/target-dir)
rt=${1:-}
if [ -z "$rt" ]; then
  if [ -e /proc/driver/nvidia ]; then rt=cuda; elif [ -e /dev/kfd ]; then rt=hip; else
    echo "gpu-check: no GPU found (no /proc/driver/nvidia, no /dev/kfd); 'scripts/gpu-check.sh sim' runs on the simulated device" >&2
    exit 2
  fi
fi
ranks=${2:-2} max=${3:-16777216}
features=()
case "$rt" in
  cuda) features=(--features roccl/cuda) ;;
  hip) export HIP_PATH=${HIP_PATH:-/opt/rocm}; features=(--features roccl/hip) ;;
  sim) export ROCCL_SIM_DELAY_US=${ROCCL_SIM_DELAY_US:-0} ;;
  *) echo "gpu-check: unknown runtime '$rt' (cuda, hip or sim)" >&2; exit 2 ;;
esac
cargo build --release --quiet -p roccl-capi-core --example gpu_check --example gpu_capture "${features[@]}"
cargo build --release --quiet -p roccl --bin roccl-perf "${features[@]}"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n), runtime $rt"
ROCCL_DEVICE=$rt $target/release/examples/gpu_check "$ranks" "$max"
ROCCL_DEVICE=$rt $target/release/examples/gpu_capture "$ranks" "$((max / 4))"
$target/release/roccl-perf --op all_reduce,all_gather,broadcast,reduce_scatter --ranks "$ranks" \
  --device "$rt" -b 1K -e "$max" -f 16 --iters 20 --warmup 5
