#!/usr/bin/env bash
# Build the C ABI, compile the C and C++ tests and the example against include/roccl.h and
# libroccl, run them, and check that the header declares exactly the exported symbols.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p roccl-capi --quiet
target=$(scripts/target-dir)
lib=$target/release
out=$target/ctests
mkdir -p "$out"
cflags=(-std=c11 -Wall -Wextra -Werror -O1 -Iinclude)

echo "-- header declares exactly the exported symbols"
exported=$(nm -D --defined-only "$lib/libroccl.so" | awk '$2 == "T" {print $3}' | sort)
declared=$(grep -oE '^(rocclResult_t|const char\*) roccl[A-Za-z]+\(' include/roccl.h | sed -E 's/.* (roccl[A-Za-z]+)\(/\1/' | sort)
if [ "$exported" != "$declared" ]; then
  echo "header and library disagree:"; diff <(echo "$declared") <(echo "$exported") || true; exit 1
fi
echo "$(echo "$exported" | wc -l) functions match"
others=$(nm -D --defined-only "$lib/libroccl.so" | awk '{print $3}' | grep -v '^roccl' || true)
[ -z "$others" ] || { echo "non-roccl symbols exported: $others"; exit 1; }
readelf -d "$lib/libroccl.so" | grep 'SONAME.*libroccl.so.0' >/dev/null || { echo "no soname"; exit 1; }

# Lay the library out as installed: the real file under its soname, libroccl.so a link.
mkdir -p "$out/lib"
cp -f "$lib/libroccl.so" "$out/lib/libroccl.so.0"
ln -sf libroccl.so.0 "$out/lib/libroccl.so"
dyn="$out/lib"

echo "-- C tests (shared library)"
gcc "${cflags[@]}" tests/c/test_collectives.c -o "$out/test_collectives" -L"$dyn" -lroccl -lpthread -lm -Wl,-rpath,"$dyn"
gcc "${cflags[@]}" tests/c/test_initall.c -o "$out/test_initall" -L"$dyn" -lroccl -lm -Wl,-rpath,"$dyn"
echo "-- C++ test (header is C++-clean)"
g++ -std=c++17 -Wall -Wextra -Werror -Iinclude tests/c/test_cxx.cpp -o "$out/test_cxx" -L"$dyn" -lroccl -Wl,-rpath,"$dyn"
echo "-- example, linked statically"
gcc "${cflags[@]}" examples/allreduce.c -o "$out/example_static" "$lib/libroccl.a" -lpthread -ldl -lm
export ROCCL_SOCKET_IFNAME=lo ROCCL_TIMEOUT=20
"$out/test_collectives"
"$out/test_initall"
"$out/test_cxx"
echo "-- the same C programs over the userspace RoCE v2 network"
ROCCL_NET=rocev2 "$out/test_collectives"
ROCCL_NET=rocev2 "$out/test_initall"
"$out/example_static" 3 | tee "$out/example.txt"
grep -q "on 3 ranks: ok" "$out/example.txt"
echo "-- C ABI tests passed"
