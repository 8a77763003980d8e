#!/usr/bin/env bash
# Soft-RoCE VMs for the tests: a Debian kernel with Linux's rdma_rxe, booted by qemu (TCG, no
# KVM needed) with the host's root file system shared read-only over 9p, so every program and
# library of the host (the build, rdma-core, perftest, python) runs inside unchanged.
#
# Sourced by tests/rxe/run.sh. Functions:
#   rxe_prepare          installs qemu and the guest kernel on first use (cached), or returns 1
#                        with the reason in $rxe_skip
#   rxe_boot NAME IP NET SCRIPT
#                        boots VM NAME in the background; inside it, eth0 gets IP (a.b.c.d/n),
#                        rxe0 is made on eth0 and SCRIPT (a host path, run by bash in the host's
#                        root) runs; NET is "user" (qemu's own network: the VM alone) or
#                        "tap:IFNAME" (a tap that the caller made, in the namespace it runs in;
#                        $RXE_NETNS names that namespace)
#   rxe_wait NAME SECONDS
#                        waits for NAME's script, prints its output; returns the script's exit
#                        code, or 124 if it did not end in time (the VM is then killed)
#   rxe_watch NAME...    in the background: marks a VM that ended before its script
#                        ($RXE_OUT/ended.NAME, what its console says)
#   rxe_cleanup          kills every VM still running (also on exit)
#
# The guest sees the host's files at their host paths; /tmp is its own, except $RXE_OUT (a
# directory under /tmp, shared read-write), where scripts leave what the host should read.
set -uo pipefail

RXE_CACHE=${ROCCL_CACHE:-$HOME/.cache/roccl}/rxe
RXE_OUT=${RXE_OUT:-$(mktemp -d /tmp/roccl-rxe.XXXXXX)}
RXE_MEM=${RXE_MEM:-2048}
RXE_CPUS=${RXE_CPUS:-2}
RXE_NETNS=${RXE_NETNS:-}
rxe_skip=""
declare -A rxe_pids=()

# Modules in load order (Debian's kernel package has no modules.dep for a bare initramfs).
RXE_MODULES="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci failover
net_failover virtio_net 9pnet 9pnet_virtio netfs fscache 9p ib_core ib_uverbs udp_tunnel
ip6_udp_tunnel crc32_generic rdma_rxe"

rxe_log() { echo "rxe: $*" >&2; }

# The guest's /init: mounts, modules, the network and rxe0, then the host's root, then the
# script; its exit code goes to $RXE_OUT/NAME.rc and the VM powers off.
rxe_init_script() {
  cat <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod /modules/$m.ko 2>/dev/null || echo "init: insmod $m failed"; done
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^roccl\.$1=//p"; }
name=$(arg name); ip=$(arg ip); out=$(arg out); script=$(arg script)
ip link set lo up
ip link set eth0 up && ip addr add "$ip" dev eth0
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose root /host ||
  { echo "init: cannot mount the host's root"; poweroff -f; }
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm; mount -t devpts devpts /host/dev/pts 2>/dev/null; mount -t tmpfs shm /host/dev/shm
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run
mkdir -p "/host$out"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "/host$out"
chroot /host /usr/bin/rdma link add rxe0 type rxe netdev eth0 || echo "init: rdma link add failed"
ulimit -l unlimited
# The script runs in the host's root with a sane environment; RXE_NAME and RXE_IP name this VM.
chroot /host /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root \
  RXE_NAME="$name" RXE_IP="${ip%/*}" RXE_OUT="$out" /bin/bash "$script" >"/host$out/$name.log" 2>&1
echo $? >"/host$out/$name.rc"
sync; umount "/host$out"
poweroff -f
EOF
}

# Installs what the host lacks, fetches the guest kernel once (cached) and builds the
# initramfs when its init changed.
rxe_prepare() {
  if [ "$(id -u)" != 0 ]; then rxe_skip="not root (qemu's tap network and the image need root)"; return 1; fi
  local need=()
  command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
  command -v busybox >/dev/null || need+=(busybox-static)
  command -v cpio >/dev/null || need+=(cpio)
  command -v rdma >/dev/null || need+=(iproute2)
  dpkg -s perftest >/dev/null 2>&1 || need+=(perftest)
  dpkg -s ibverbs-utils >/dev/null 2>&1 || need+=(ibverbs-utils)
  dpkg -s ibverbs-providers >/dev/null 2>&1 || need+=(ibverbs-providers)
  if [ ${#need[@]} -gt 0 ]; then
    rxe_log "installing ${need[*]}"
    (apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 ||
      (apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1)) ||
      { rxe_skip="could not install ${need[*]} with apt-get"; return 1; }
  fi
  [ -f "$RXE_CACHE/vmlinuz" ] && [ -d "$RXE_CACHE/modules" ] || rxe_fetch_kernel || return 1
  local sum
  sum=$( (rxe_init_script; echo $RXE_MODULES; sha256sum /bin/busybox) | sha256sum | cut -c1-16)
  RXE_INITRD=$RXE_CACHE/initrd-$sum.gz
  [ -f "$RXE_INITRD" ] || rxe_build_initrd
}

rxe_fetch_kernel() {
  local pkg work kver m f
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
  [ -n "$pkg" ] || { apt-get update >/dev/null 2>&1; pkg=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1); }
  [ -n "$pkg" ] || { rxe_skip="apt knows no linux-image-amd64 (the guest kernel)"; return 1; }
  rxe_log "fetching the guest kernel $pkg (once; cached in $RXE_CACHE)"
  work=$(mktemp -d)
  (cd "$work" && apt-get download "$pkg" >/dev/null 2>&1) || { rxe_skip="apt-get download $pkg failed"; rm -rf "$work"; return 1; }
  dpkg -x "$work"/linux-image-*.deb "$work/x"
  kver=${pkg#linux-image-}
  rm -rf "$RXE_CACHE" && mkdir -p "$RXE_CACHE/modules.tmp"
  for m in $RXE_MODULES; do
    f=$(find "$work/x/lib/modules/$kver" -name "$m.ko" | head -1)
    [ -n "$f" ] || { rxe_skip="$pkg has no module $m"; rm -rf "$work"; return 1; }
    cp "$f" "$RXE_CACHE/modules.tmp/"
  done
  cp "$work/x/boot/vmlinuz-$kver" "$RXE_CACHE/vmlinuz"
  echo "$pkg" >"$RXE_CACHE/kernel"
  mv "$RXE_CACHE/modules.tmp" "$RXE_CACHE/modules"
  rm -rf "$work"
}

rxe_build_initrd() {
  local work
  work=$(mktemp -d)
  mkdir -p "$work"/{bin,proc,sys,dev}
  cp /bin/busybox "$work/bin/busybox"
  cp -r "$RXE_CACHE/modules" "$work/modules"
  echo $RXE_MODULES >"$work/modules.list"
  rxe_init_script >"$work/init"
  chmod +x "$work/init"
  rm -f "$RXE_CACHE"/initrd-*.gz
  (cd "$work" && find . | cpio -o -H newc 2>/dev/null | gzip -1) >"$RXE_INITRD.tmp" && mv "$RXE_INITRD.tmp" "$RXE_INITRD"
  rm -rf "$work"
}

rxe_boot() {
  local name=$1 ip=$2 net=$3 script=$4 netdev mac
  mac=$(printf '52:54:00:99:00:%02x' "$(echo "${ip%/*}" | cut -d. -f4)")
  case $net in
    user) netdev="user,id=n0" ;;
    tap:*) netdev="tap,id=n0,ifname=${net#tap:},script=no,downscript=no" ;;
    *) rxe_log "unknown network $net"; return 1 ;;
  esac
  rm -f "$RXE_OUT/$name.rc" "$RXE_OUT/$name.log"
  # The guest's /tmp is its own: the script travels through $RXE_OUT.
  cp "$script" "$RXE_OUT/$name.sh" && script="$RXE_OUT/$name.sh"
  local ns=()
  [ -n "$RXE_NETNS" ] && ns=(ip netns exec "$RXE_NETNS")
  # tsc=reliable: the guest reads time from the TSC (TCG's follows the host's clock), as a
  # host does, not from the emulated HPET, whose every read is an exit into qemu (2.9 us a
  # clock_gettime; it made an 8-byte all-reduce between two VMs about 20 % slower).
  # $RXE_APPEND: more of the kernel's command line.
  "${ns[@]}" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp "$RXE_CPUS" -m "$RXE_MEM" \
    -nographic -no-reboot -nodefaults -serial file:"$RXE_OUT/$name.console" \
    -kernel "$RXE_CACHE/vmlinuz" -initrd "$RXE_INITRD" \
    -append "console=ttyS0 quiet panic=-1 tsc=reliable roccl.name=$name roccl.ip=$ip roccl.out=$RXE_OUT roccl.script=$script ${RXE_APPEND:-}" \
    -netdev "$netdev" -device virtio-net-pci,netdev=n0,mac="$mac",romfile= \
    -virtfs local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$RXE_OUT",mount_tag=out,security_model=none,multidevs=remap \
    >"$RXE_OUT/$name.qemu" 2>&1 &
  rxe_pids[$name]=$!
  echo $! >"$RXE_OUT/$name.pid"
}

rxe_wait() {
  local name=$1 limit=$2 pid=${rxe_pids[$1]} start=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    unset "rxe_pids[$name]"
    rxe_log "VM $name did not finish within ${limit}s; its output so far:"
    cat "$RXE_OUT/$name.log" 2>/dev/null; tail -20 "$RXE_OUT/$name.console" 2>/dev/null
    return 124
  fi
  wait "$pid" 2>/dev/null
  unset "rxe_pids[$name]"
  cat "$RXE_OUT/$name.log" 2>/dev/null
  if [ ! -f "$RXE_OUT/$name.rc" ]; then
    # On stderr, with the note: callers may throw the script's output away, not this.
    { rxe_log "VM $name ended without running its script; console and qemu output:"
      rxe_oops "$name"; tail -30 "$RXE_OUT/$name.console" 2>/dev/null; cat "$RXE_OUT/$name.qemu" 2>/dev/null; } >&2
    return 125
  fi
  return "$(cat "$RXE_OUT/$name.rc")"
}

# The gist of a kernel oops or panic on NAME's console, if it has one: what failed, where,
# and the call trace's frames in modules (rdma_rxe's among them).
rxe_oops() {
  grep -aoE "(BUG:|Oops:|Kernel panic).*|RIP: .*|[a-z_0-9.]+\+0x[0-9a-f]+/0x[0-9a-f]+ \[[a-z_0-9]+\]" \
    "$RXE_OUT/$1.console" 2>/dev/null | awk '!seen[$0]++' | head -12 | sed "s/^/rxe: VM $1: /"
}

# Run in the background: when a VM ends before its script did (its kernel crashed), leaves
# $RXE_OUT/ended.NAME saying so, for the other machines' barriers (tests/rxe/jobs.sh).
rxe_watch() {
  local n pid
  while sleep 1; do
    for n in "$@"; do
      pid=$(cat "$RXE_OUT/$n.pid" 2>/dev/null) || continue
      [ -f "$RXE_OUT/ended.$n" ] || [ -f "$RXE_OUT/$n.rc" ] || kill -0 "$pid" 2>/dev/null ||
        echo "VM $n ended before its script: $(rxe_oops "$n" | head -1 | cut -c1-160)" >"$RXE_OUT/ended.$n"
    done
  done
}

rxe_cleanup() {
  local n
  for n in "${!rxe_pids[@]}"; do kill -9 "${rxe_pids[$n]}" 2>/dev/null; done
  rxe_pids=()
}
