#!/usr/bin/env bash
# Compile tests/nccl/header/test_header.c against NCCL 2.32's real nccl.h and link it against
# libroccl-nccl.so alone (no NCCL library), then run it.
#
#   tests/nccl/header/run.sh LIBDIR    (the directory holding libroccl_nccl.so)
#
# The header comes from the nvidia-nccl-cu13 wheel on PyPI (downloaded once into
# ~/.cache/roccl/nccl-header, or ROCCL_NCCL_HEADER_DIR); CUDA's own headers are replaced by
# the few names nccl.h needs (cuda_stub/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
libdir=$(cd "$1" && pwd)
version=2.32.3
cache=${ROCCL_NCCL_HEADER_DIR:-$HOME/.cache/roccl/nccl-header}
inc="$cache/$version/include"
if [ ! -f "$inc/nccl.h" ]; then
  echo "-- downloading nvidia-nccl-cu13==$version (for its nccl.h) into $cache"
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "nvidia-nccl-cu13==$version"
  mkdir -p "$inc"
  python3 - "$tmp" "$inc" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/include/nccl.h"))
    open(sys.argv[2] + "/nccl.h", "wb").write(z.read(name))
PY
  rm -rf "$tmp"
fi
grep -q "define NCCL_VERSION_CODE 23203" "$inc/nccl.h" || { echo "not NCCL 2.32.3's nccl.h: $inc/nccl.h"; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The library's soname is libroccl-nccl.so (as installed); cargo names the file libroccl_nccl.so.
ln -s "$libdir/libroccl_nccl.so" "$out/libroccl-nccl.so"
gcc -std=c11 -Wall -Werror -Wno-enum-compare -Wno-deprecated-declarations -DNCCL_OS_LINUX -I "$here/cuda_stub" -I "$inc" -I "$root/include" "$here/test_header.c" \
  -o "$out/test_header" -L "$out" -l:libroccl-nccl.so -Wl,--no-undefined -Wl,-rpath,"$out"
ROCCL_SOCKET_IFNAME=lo "$out/test_header"
