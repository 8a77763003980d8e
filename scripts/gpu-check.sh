#!/usr/bin/env bash
# On a machine with a GPU: build roccl with the GPU runtime and run stream-ordered
# collectives on device buffers (ranks as threads sharing the GPU), every result checked,
# printing a short table. Not part of CI, which runs the same program on the simulated device.
#   scripts/gpu-check.sh [cuda|hip|sim] [RANKS] [MAX_BYTES]
# Default runtime: cuda when an NVIDIA driver is present, hip when /dev/kfd exists.
set -euo pipefail
cd "$(dirname "$0")/.."
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
cargo build --release --quiet -p roccl-capi-core --example gpu_check "${features[@]}"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n), runtime $rt"
ROCCL_DEVICE=$rt target/release/examples/gpu_check "$ranks" "$max"
