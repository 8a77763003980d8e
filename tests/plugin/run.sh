#!/usr/bin/env bash
# Install roccl (scripts/install.sh --prefix target/plugin/prefix), check that every name NCCL
# and RCCL load a network plugin by is installed and found by each loader's lookup order
# (tests/plugin/harness.c --lookup: the facts it relies on, with their sources, are in its
# comment "The loaders' lookup"), then drive the plugin with tests/plugin/harness.c (every
# exported version, over TCP and over RoCE v2 in userspace, and through the RCCL file name).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/plugin
prefix="$PWD/$out/prefix"
lib="$prefix/lib"
def="$lib/net-plugin-default"
mkdir -p "$out"
rm -rf "$prefix"
echo "-- scripts/install.sh --prefix $out/prefix"
scripts/install.sh --prefix "$prefix" >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
for f in "$lib/libnccl-net-roccl.so" "$lib/librccl-net-roccl.so" "$def/libnccl-net.so" "$def/librccl-net.so"; do
  [ -f "$f" ] || { echo "install.sh did not install $f"; exit 1; }
  echo "   ${f#"$prefix/"}"
done

echo "-- exported symbols: only the plugin tables"
want="ncclNetPlugin_v10 ncclNetPlugin_v11 ncclNetPlugin_v12 ncclNetPlugin_v8 ncclNetPlugin_v9 "
for f in "$lib/libnccl-net-roccl.so" "$lib/librccl-net-roccl.so"; do
  syms=$(nm -D --defined-only "$f" | awk '{print $3}' | sort | tr '\n' ' ')
  if [ "$syms" != "$want" ]; then
    echo "$f exports: $syms"
    echo "wanted:   $want"
    exit 1
  fi
done
echo "   $want"

gcc -std=c11 -Wall -Wextra -Werror -O1 tests/plugin/harness.c -o "$out/harness" -ldl
export ROCCL_SOCKET_IFNAME=lo ROCCL_TIMEOUT=30 ROCCL_NET=tcp
unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT

# lookup LOADER LD_LIBRARY_PATH EXPECT VERSION [VALUE]: the harness finds the plugin as LOADER
# would with NCCL_NET_PLUGIN=VALUE (unset without VALUE) and that LD_LIBRARY_PATH, and checks
# that it ends with EXPECT (a path, or "none") at ncclNetPlugin_vVERSION. Prints the case and
# its outcome; everything the harness tried when it fails.
lookup() {
  local loader=$1 ldpath=$2 expect=$3 version=$4 log
  local -a setenv=(env -u NCCL_NET_PLUGIN)
  [ $# -ge 5 ] && setenv=(env NCCL_NET_PLUGIN="$5")
  if ! log=$("${setenv[@]}" LD_LIBRARY_PATH="$ldpath" "$out/harness" --lookup "$loader" "$expect" "$version" </dev/null 2>&1); then
    echo "$log"
    return 1
  fi
  log=${log//"$prefix"/PREFIX}
  printf '%s %s\n' "${log%%$'\n'*}" "$(tail -n1 <<<"$log" | sed 's/^ *//')"
}

# The lookup of every loader for every way of naming the plugin. Per loader: the file prefix,
# the version it must take, and what each case must end at (D: the default name from
# lib/net-plugin-default, F: lib/<prefix>-roccl.so, -: no external plugin), for NCCL_NET_PLUGIN
# unset, "roccl", the full path of F, F's file name, "nosuch,roccl", "none", "" (empty).
loaders="nccl        libnccl-net 12 DFFFF--
nccl-2.28   libnccl-net 11 DFFFF--
nccl-2.27   libnccl-net 10 DFFFF--
nccl-2.27.3 libnccl-net 10 DF-FF--
nccl-2.26   libnccl-net 10 DFFF--D
rccl        librccl-net 12 DFFFF--
rccl-6.3    librccl-net 8  DFFF--D
rccl-6.2    librccl-net 8  DF----D
rccl-6.1    librccl-net 0  -------"
echo "-- each loader's lookup order (NCCL_NET_PLUGIN), from the installed names"
while read -r id pre ver want; do
  file="$pre-roccl.so"
  # each case: NCCL_NET_PLUGIN (--unset: unset)|LD_LIBRARY_PATH
  i=0
  for c in "--unset|$def" "roccl|$lib" "$lib/$file|" "$file|$lib" "nosuch,roccl|$lib" "none|$lib:$def" "|$def"; do
    value=${c%|*} ldpath=${c##*|}
    case ${want:i:1} in
      D) expect="$def/$pre.so" ;;
      F) expect="$lib/$file" ;;
      *) expect=none ;;
    esac
    i=$((i + 1))
    if [ "$value" = --unset ]; then
      lookup "$id" "$ldpath" "$expect" "$ver"
    else
      lookup "$id" "$ldpath" "$expect" "$ver" "$value"
    fi
  done
done <<<"$loaders"

echo "-- a missing name is noticed: a lookup fails once the name it found is removed"
for name in "$def/libnccl-net.so" "$lib/librccl-net-roccl.so"; do
  mv "$name" "$name.away"
  case "$name" in
    "$def"/*) if lookup nccl "$def" "$name" 12 >"$out/missing.log" 2>&1; then bad=1; else bad=0; fi ;;
    *) if lookup rccl "$lib" "$name" 12 roccl >"$out/missing.log" 2>&1; then bad=1; else bad=0; fi ;;
  esac
  mv "$name.away" "$name"
  if [ "$bad" = 1 ]; then
    echo "the lookup found the plugin without ${name#"$prefix/"}"
    cat "$out/missing.log"
    exit 1
  fi
  echo "   without ${name#"$prefix/"}: $(grep -m1 FAIL "$out/missing.log" | sed "s|$prefix|PREFIX|g")"
done

export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
