#!/usr/bin/env bash
# Build the NCCL/RCCL net plugin, lay it out under the names the loaders look for, and drive
# it with tests/plugin/harness.c (every exported version, over TCP and over RoCE v2 in
# userspace, and through the RCCL file name).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p roccl-netplugin --quiet
out=target/plugin
mkdir -p "$out/lib"
cp -f target/release/libnccl_net_roccl.so "$out/lib/libnccl-net-roccl.so"
cp -f target/release/libnccl_net_roccl.so "$out/lib/librccl-net-roccl.so"

echo "-- exported symbols: only the plugin tables"
syms=$(nm -D --defined-only "$out/lib/libnccl-net-roccl.so" | awk '{print $3}' | sort | tr '\n' ' ')
want="ncclNetPlugin_v10 ncclNetPlugin_v11 ncclNetPlugin_v12 ncclNetPlugin_v8 ncclNetPlugin_v9 "
if [ "$syms" != "$want" ]; then
  echo "exported: $syms"
  echo "wanted:   $want"
  exit 1
fi
echo "   $syms"

gcc -std=c11 -Wall -Wextra -Werror -O1 tests/plugin/harness.c -o "$out/harness" -ldl
export LD_LIBRARY_PATH="$PWD/$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ROCCL_SOCKET_IFNAME=lo ROCCL_TIMEOUT=30
unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT
for net in tcp rocev2; do
  echo "-- NCCL_NET_PLUGIN=roccl (libnccl-net-roccl.so), ROCCL_NET=$net"
  ROCCL_NET=$net timeout -k 5 300 "$out/harness" libnccl-net-roccl.so
done
echo "-- GPU memory (NCCL_PTR_CUDA, regMrDmaBuf) on the userspace engine: no eager copies, asynchronous iflush"
ROCCL_NET=rocev2 ROCCL_ROCEV2_SIM_GPU=1 timeout -k 5 300 "$out/harness" libnccl-net-roccl.so
echo "-- RCCL's file name (librccl-net-roccl.so), ROCCL_NET=rocev2"
ROCCL_NET=rocev2 timeout -k 5 300 "$out/harness" librccl-net-roccl.so
echo "-- no usable network: init fails cleanly (NCCL falls back to its own)"
if ROCCL_NET=verbs "$out/harness" libnccl-net-roccl.so >"$out/noverbs.log" 2>&1; then
  if [ -d /sys/class/infiniband ] && [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    echo "   (this host has an RDMA device: init succeeded, nothing to check)"
  else
    echo "init succeeded with ROCCL_NET=verbs on a host without an RDMA NIC"
    cat "$out/noverbs.log"
    exit 1
  fi
else
  grep -q "init failed" "$out/noverbs.log" || { cat "$out/noverbs.log"; exit 1; }
  echo "   init returned an error, as it must"
fi
