#!/usr/bin/env bash
# Build roccl in release mode and install it under --prefix DIR:
#   bin/roccl-perf, bin/roccl-info
#   include/roccl.h
#   lib/libroccl.so.0.1.0, lib/libroccl.so.0 -> ..., lib/libroccl.so -> ...   (soname libroccl.so.0)
#   lib/libroccl.a
#   lib/pkgconfig/roccl.pc        (pkg-config --cflags --libs roccl)
#   lib/libnccl-net-roccl.so, lib/librccl-net-roccl.so   (NCCL/RCCL network plugin,
#                                 NCCL_NET_PLUGIN=roccl; docs/PLUGIN.md)
#   lib/net-plugin-default/libnccl-net.so -> ../libnccl-net-roccl.so
#   lib/net-plugin-default/librccl-net.so -> ../librccl-net-roccl.so
#                                 (the names NCCL and RCCL load with NCCL_NET_PLUGIN unset:
#                                 LD_LIBRARY_PATH=$prefix/lib/net-plugin-default. Not in lib/:
#                                 where lib/ is on the loader's path (LD_LIBRARY_PATH for
#                                 libroccl, or /usr/local/lib with ldconfig) every NCCL/RCCL
#                                 program would take roccl as its network without asking)
#   lib/libroccl-nccl.so          (roccl under NCCL's names and ABI: VLLM_NCCL_SO_PATH)
#   lib/nccl-compat/libnccl.so.2, lib/nccl-compat/librccl.so.1 -> ../libroccl-nccl.so
#                                 (for programs that load NCCL/RCCL by those names:
#                                 LD_LIBRARY_PATH=$prefix/lib/nccl-compat; docs/GPU.md)
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
version=$(sed -n 's/^version = "\(.*\)"/\1/p' ffi/capi/Cargo.toml | head -1)
# Every default target of the four packages: roccl's lib and bins, the C ABI's cdylib and
# staticlib, the plugin and the NCCL-named library (naming `--bin` targets here would build
# only those two and leave the libraries to whatever an earlier build left behind).
cargo build --release -p roccl -p roccl-capi -p roccl-netplugin -p roccl-nccl
# Where cargo put them: CARGO_TARGET_DIR, build.target-dir of a cargo config, or target/.
target_dir=$(scripts/target-dir)
out="$target_dir/release"
for f in roccl-perf roccl-info libroccl.so libroccl.a libnccl_net_roccl.so libroccl_nccl.so; do
  [ -f "$out/$f" ] || { echo "install.sh: cargo build did not produce $out/$f" >&2; exit 1; }
done
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
install -d "$prefix/bin" "$prefix/include" "$prefix/lib/pkgconfig"
install -m 0755 "$out"/roccl-perf "$prefix/bin/roccl-perf"
install -m 0755 "$out"/roccl-info "$prefix/bin/roccl-info"
install -m 0644 include/roccl.h "$prefix/include/roccl.h"
install -m 0755 "$out"/libroccl.so "$prefix/lib/libroccl.so.$version"
strip --strip-debug "$prefix/lib/libroccl.so.$version" 2>/dev/null || true
ln -sf "libroccl.so.$version" "$prefix/lib/libroccl.so.0"
ln -sf "libroccl.so.0" "$prefix/lib/libroccl.so"
install -m 0644 "$out"/libroccl.a "$prefix/lib/libroccl.a"
for name in libnccl-net-roccl.so librccl-net-roccl.so; do
  install -m 0755 "$out"/libnccl_net_roccl.so "$prefix/lib/$name"
  strip --strip-debug "$prefix/lib/$name" 2>/dev/null || true
done
# NCCL_NET_PLUGIN unset: NCCL dlopens libnccl-net.so, RCCL librccl-net.so (docs/PLUGIN.md).
install -d "$prefix/lib/net-plugin-default"
ln -sf ../libnccl-net-roccl.so "$prefix/lib/net-plugin-default/libnccl-net.so"
ln -sf ../librccl-net-roccl.so "$prefix/lib/net-plugin-default/librccl-net.so"
install -m 0755 "$out"/libroccl_nccl.so "$prefix/lib/libroccl-nccl.so"
strip --strip-debug "$prefix/lib/libroccl-nccl.so" 2>/dev/null || true
install -d "$prefix/lib/nccl-compat"
ln -sf ../libroccl-nccl.so "$prefix/lib/nccl-compat/libnccl.so.2"
ln -sf ../libroccl-nccl.so "$prefix/lib/nccl-compat/librccl.so.1"
cat > "$prefix/lib/pkgconfig/roccl.pc" <<PC
prefix=$prefix
includedir=\${prefix}/include
libdir=\${prefix}/lib

Name: roccl
Description: Collective communications for RoCE v2 and Ethernet clusters (NCCL-style API)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lroccl
Libs.private: -lpthread -ldl -lm
PC
echo "installed roccl $version under $prefix"
