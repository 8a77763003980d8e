#!/usr/bin/env bash
# Capture the RoCE v2 traffic of a short roccl-perf run between two emulated hosts and check
# it with Wireshark's dissectors.
#
#   scripts/capture.sh [OUT.pcapng]      (default: target/capture/roccl-rocev2.pcapng)
#
# Two network namespaces (roccl-cap0, roccl-cap1: eth0 at 10.78.0.1 and 10.78.0.2, a veth
# pair with MTU 9000) each run one rank of roccl-perf (--net rocev2: all_reduce and
# all_gather) while dumpcap records UDP port 4791 on the second host's eth0. UDP segmentation
# offload is turned off on both veth ends, so the kernel cuts roccl's UDP GSO sends into
# single datagrams in software, as a NIC does on the wire (on lo or an offloading veth a
# capture would show the unsplit 64 KiB sends instead). Checks:
#   - there are InfiniBand (RoCE v2) packets, and every captured datagram decodes as one;
#   - none is malformed;
#   - the ICRC of every packet: Wireshark 4.0 shows the ICRC but does not verify it (this is
#     reported), so it is recomputed here from the captured bytes (IBA Annex A17: CRC-32 over
#     8 bytes of 1s, then the IPv4 header with TOS, TTL and checksum set to 1s, the UDP header
#     with checksum 1s, the BTH with its first reserved byte 1s, the rest of the transport
#     headers and payload), independently of roccl's code, when python3 is available;
#   - the IPv4 identification and DF flag: DF set, and the identification below 64 (a packet's
#     index in a UDP GSO send, 0 for packets sent alone; roccl's receiver recovers it from the
#     ICRC), and some packets with a non-zero one (GSO was exercised);
#   - a clean wire: every reserved field is zero (BTH: the six bits of byte 4, the seven of
#     byte 8, the transport version; the pad bytes).
# Prints the packet count per BTH opcode. Exits non-zero when a check fails.
# Needs root (namespaces, capture); installs tshark and ethtool with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-target/capture/roccl-rocev2.pcapng}
PORT0=4791
PORT1=4791
NS=(roccl-cap0 roccl-cap1)
ADDR=(10.78.0.1 10.78.0.2)
ROOT=${ADDR[0]}:29650
PERF=$(scripts/target-dir)/release/roccl-perf
ARGS=(--op "all_reduce,all_gather" -b 8 -e 64K -f 8 --iters 2 --warmup 1 --net rocev2)

die() {
  echo "capture.sh: error: $*" >&2
  exit 1
}

# A clean run: no fault injection or port settings from the caller's environment.
unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT ROCCL_NET
[ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, capture)"
if ! command -v ethtool >/dev/null; then
  command -v apt-get >/dev/null || die "ethtool not found and no apt-get to install it"
  echo "-- installing ethtool"
  DEBIAN_FRONTEND=noninteractive apt-get install -y ethtool >/dev/null 2>&1 ||
    { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y ethtool >/dev/null; } ||
    die "apt-get install ethtool failed"
fi
if ! command -v tshark >/dev/null || ! command -v dumpcap >/dev/null; then
  command -v apt-get >/dev/null || die "tshark not found and no apt-get to install it"
  echo "-- installing tshark"
  echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y tshark >/dev/null 2>&1 ||
    { apt-get update >/dev/null && apt-get install -y tshark >/dev/null; } ||
    die "apt-get install tshark failed"
fi
ts() { tshark "$@" 2>&1 | grep -v '^Running as user "root"' || true; }
tshark -G protocols 2>/dev/null | awk -F'\t' '$3 == "infiniband"' | grep . >/dev/null ||
  die "this tshark has no InfiniBand dissector"

echo "-- build roccl-perf"
cargo build --release --quiet --bin roccl-perf

mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"
tmp=$(mktemp -d)
cap_pid=""
rank_pids=()
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  local p
  for p in "${rank_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -z "$cap_pid" ] || kill "$cap_pid" 2>/dev/null || true
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

echo "-- hosts ${NS[0]} (${ADDR[0]}) and ${NS[1]} (${ADDR[1]}): veth, MTU 9000, tx-udp-segmentation off"
for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
ip link del roccl-capa 2>/dev/null || true
for r in 0 1; do
  ip netns add "${NS[$r]}" || die "ip netns add ${NS[$r]} failed"
done
ip link add roccl-capa type veth peer name roccl-capb || die "cannot create a veth pair"
ip link set roccl-capa netns "${NS[0]}"
ip link set roccl-capb netns "${NS[1]}"
ends=(roccl-capa roccl-capb)
for r in 0 1; do
  ip -n "${NS[$r]}" link set "${ends[$r]}" name eth0
  ip -n "${NS[$r]}" link set eth0 mtu 9000
  ip -n "${NS[$r]}" addr add "${ADDR[$r]}/24" dev eth0
  ip -n "${NS[$r]}" link set lo up
  ip -n "${NS[$r]}" link set eth0 up
  ip netns exec "${NS[$r]}" ethtool -K eth0 tx-udp-segmentation off >/dev/null 2>&1 ||
    die "ethtool -K eth0 tx-udp-segmentation off failed in ${NS[$r]}"
done

capture_run() {
  filter="udp port $PORT0 or udp port $PORT1"
  echo "-- ip netns exec ${NS[1]} dumpcap -i eth0 -f \"$filter\" -w $OUT"
  ip netns exec "${NS[1]}" dumpcap -q -i eth0 -f "$filter" -w "$OUT" 2>"$tmp/dumpcap.err" &
  cap_pid=$!
  for _ in $(seq 100); do
    grep -q "Capturing on" "$tmp/dumpcap.err" && break
    kill -0 "$cap_pid" 2>/dev/null || { cat "$tmp/dumpcap.err"; die "dumpcap failed to start"; }
    sleep 0.1
  done
  grep -q "Capturing on" "$tmp/dumpcap.err" || { cat "$tmp/dumpcap.err"; die "dumpcap did not start"; }
  sleep 1 # "Capturing on" can come a moment before packets are really recorded

  echo "-- 2 ranks: ip netns exec roccl-capR env ROCCL_RANK=R ROCCL_NRANKS=2 ROCCL_ROOT=$ROOT" \
    "ROCCL_SOCKET_IFNAME==eth0 $PERF ${ARGS[*]}"
  ports=("$PORT0" "$PORT1")
  for r in 0 1; do
    ip netns exec "${NS[$r]}" env ROCCL_RANK=$r ROCCL_NRANKS=2 ROCCL_ROOT="$ROOT" \
      ROCCL_SOCKET_IFNAME==eth0 ROCCL_TIMEOUT=60 ROCCL_DEBUG=INFO \
      timeout -k 5 120 "$PERF" "${ARGS[@]}" >"$tmp/rank$r.log" 2>&1 &
    rank_pids+=($!)
  done
  fail=0
  for r in 0 1; do
    rc=0
    wait "${rank_pids[$r]}" || rc=$?
    [ "$rc" -eq 0 ] || { echo "rank $r exited with $rc"; fail=1; }
  done
  rank_pids=()
  sleep 1 # let dumpcap see and write the last packets
  kill -INT "$cap_pid"
  wait "$cap_pid" || true
  cap_pid=""
  grep -qx "# wrong results: 0" "$tmp/rank0.log" || { echo "rank 0 did not report '# wrong results: 0'"; fail=1; }
  for r in 0 1; do
    grep -q "RoCE v2 on ${ADDR[$r]}:${ports[$r]} " "$tmp/rank$r.log" || {
      echo "rank $r did not listen on ${ADDR[$r]}:${ports[$r]} (port taken? see below)"
      fail=1
    }
  done
  if [ "$fail" -ne 0 ]; then
    for r in 0 1; do echo "---- rank $r"; cat "$tmp/rank$r.log"; done
    die "the roccl-perf run failed"
  fi
  [ -s "$OUT" ] || die "no capture file written"
}

capture_run
if [ "$(ts -r "$OUT" -Y udp -T fields -e frame.number | grep -c .)" -eq 0 ]; then
  # dumpcap sometimes records nothing when it starts on a busy machine: that is not roccl's
  # fault, so capture once more before judging.
  echo "-- the capture is empty (dumpcap started late?): capturing once more"
  rm -f "$OUT"
  capture_run
fi

decode=(-d "udp.port==$PORT0,infiniband" -d "udp.port==$PORT1,infiniband")
# roccl's RDMA payloads are opaque data. Wireshark guesses upper-layer protocols inside IB
# payloads with heuristics (e.g. "EtherType encapsulated" when the payload starts with bytes
# that look like an EtherType such as 0x0600) and then reports the guessed protocol as
# malformed. Turn those guesses off (the names this tshark knows), and report what they did.
heuristics=()
for h in eth_over_ib mellanox_eoib sdp_infiniband smb_direct_infiniband iser_infiniband lnet_ib \
  rpcrdma_infiniband nvme_rdma smcr_infiniband fc_infiniband drbd_rdma; do
  tshark --disable-heuristic "$h" -r "$OUT" -c 1 >/dev/null 2>&1 && heuristics+=(--disable-heuristic "$h")
done
guessed=$(ts -r "$OUT" "${decode[@]}" -Y "infiniband && _ws.malformed" -T fields -e frame.protocols |
  sed -E 's/.*:infiniband:?//' | sort | uniq -c)
decode+=("${heuristics[@]}")
count() { ts -r "$OUT" "${decode[@]}" -Y "$1" -T fields -e frame.number | grep -c '^[0-9]' || true; }
status=0

udp=$(count udp)
ib=$(count infiniband)
echo "-- decoded: $ib of $udp captured UDP datagrams are InfiniBand (RoCE v2) packets"
if [ "$ib" -eq 0 ]; then
  echo "FAIL: no InfiniBand packets decoded"
  status=1
elif [ "$ib" -ne "$udp" ]; then
  echo "FAIL: $((udp - ib)) datagrams on the RoCE v2 ports are not decoded as InfiniBand"
  status=1
fi

malformed=$(count "_ws.malformed")
echo "-- malformed packets: $malformed (with tshark's guesses at protocols inside IB payloads off)"
if [ -n "$guessed" ]; then
  echo "   (with those guesses on, payloads mis-guessed and then reported malformed:" \
    "count and guessed protocols: $(echo "$guessed" | tr -s ' \n' ' '))"
fi
if [ "$malformed" -ne 0 ]; then
  ts -r "$OUT" "${decode[@]}" -Y "_ws.malformed" | head -20
  status=1
fi
experts=$(ts -r "$OUT" "${decode[@]}" -Y "infiniband && _ws.expert.severity >= 6291456" -T fields \
  -e _ws.expert.message | sort | uniq -c)  # 6291456 = PI_WARN
if [ -n "$experts" ]; then
  echo "-- expert warnings/errors on InfiniBand packets:"
  echo "$experts"
fi

echo "-- packets per BTH opcode"
names=$(tshark -G values 2>/dev/null | awk -F'\t' '$1 == "V" && $2 == "infiniband.bth.opcode" {print $3 "\t" $4}')
ts -r "$OUT" "${decode[@]}" -Y infiniband -T fields -e infiniband.bth.opcode | sort -n | uniq -c |
  while read -r n op; do
    printf '%8d  %3s  %s\n' "$n" "$op" "$(echo "$names" | awk -F'\t' -v o="$op" '$1 == o {print $2}')"
  done
naks=$(count "infiniband.aeth.syndrome >= 0x60")
echo "   (NAKs among the acknowledges: $naks)"
# The engine's own reports use the manufacturers' opcodes (0xC0-0xFF); no acknowledgement may
# carry a syndrome of the class IBTA reserves (0b010), which a NIC would take as malformed.
reports=$(count "infiniband.bth.opcode >= 0xc0")
reserved=$(count "infiniband.bth.opcode == 17 && infiniband.aeth.syndrome >= 0x40 && infiniband.aeth.syndrome < 0x60")
echo "   (roccl reports in the manufacturer-specific opcode 0xC0: $reports; acknowledges with a reserved syndrome: $reserved)"
if [ "$reserved" -ne 0 ]; then
  echo "FAIL: $reserved acknowledges carry a syndrome IBTA reserves"
  status=1
fi

echo "-- IPv4 identification and DF of the RoCE v2 packets (count, ip.id, ip.flags.df)"
ts -r "$OUT" "${decode[@]}" -Y "infiniband && ip" -T fields -e ip.id -e ip.flags.df | sort | uniq -c |
  sort -k2 | head -20 | sed 's/^/   /'
bad_df=$(count "infiniband && ip && ip.flags.df != 1")
if [ "$bad_df" -ne 0 ]; then
  echo "FAIL: $bad_df packets without DF, which roccl's ICRC assumes"
  status=1
fi
echo "   (each identification must be below 64, and reserved fields zero: checked below)"

echo "-- ICRC"
if tshark -G fields 2>/dev/null | awk -F'\t' '{print $3}' | grep -x "infiniband.invariant.crc.status" >/dev/null; then
  badcrc=$(count "infiniband.invariant.crc.status == \"Bad\"")
  echo "   tshark verifies the ICRC: $badcrc bad"
  [ "$badcrc" -eq 0 ] || status=1
else
  echo "   this tshark ($(tshark -v 2>/dev/null | head -1 | awk '{print $3}')) shows the ICRC (infiniband.invariant.crc) but cannot verify it"
fi
if command -v python3 >/dev/null; then
  ts -r "$OUT" -F pcap -w "$tmp/cap.pcap" >/dev/null
  if ! python3 - "$tmp/cap.pcap" "$PORT0" "$PORT1" <<'EOF'; then
import struct, sys, zlib

path, ports = sys.argv[1], {int(p) for p in sys.argv[2:]}
data = open(path, "rb").read()
magic = data[:4]
if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
    end = "<"
elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
    end = ">"
else:
    sys.exit("not a pcap file")
linktype = struct.unpack(end + "I", data[20:24])[0] & 0x0FFFFFFF
off, total, good, bad, skipped = 24, 0, 0, 0, 0
id_ok, id_bad, segments, reserved_bad = 0, 0, 0, 0
while off + 16 <= len(data):
    caplen, origlen = struct.unpack(end + "II", data[off + 8:off + 16])
    pkt = data[off + 16:off + 16 + caplen]
    off += 16 + caplen
    if linktype == 1:  # Ethernet
        ip = pkt[14:] if pkt[12:14] == b"\x08\x00" else b""
    elif linktype == 113:  # Linux cooked
        ip = pkt[16:] if pkt[14:16] == b"\x08\x00" else b""
    elif linktype in (12, 101, 228):  # raw IP
        ip = pkt
    else:
        sys.exit("unsupported link type %d" % linktype)
    if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 17:
        continue
    ihl = (ip[0] & 15) * 4
    iplen = struct.unpack(">H", ip[2:4])[0]
    udp = ip[ihl:iplen]
    if len(udp) < 8 or struct.unpack(">H", udp[2:4])[0] not in ports:
        continue
    total += 1
    if caplen != origlen or len(udp) < 8 + 12 + 4:
        skipped += 1
        continue
    # roccl's convention: the IPv4 identification of a datagram cut from a UDP GSO send is its
    # segment index (0 for packets sent alone, below 64), found by the receiver from the ICRC.
    ipid = struct.unpack(">H", ip[4:6])[0]
    if ipid < 64:
        id_ok += 1
        segments += ipid > 0
    else:
        id_bad += 1
        if id_bad <= 5:
            print("   IPv4 id %d is not a GSO segment index below 64 (psn 0x%06x)"
                  % (ipid, struct.unpack(">I", bytes(udp[16:20]))[0] & 0xFFFFFF))
    # Reserved fields are sent as zero: BTH byte 4 bits 0-5, byte 8 bits 0-6, the transport
    # version (byte 1 bits 0-3), and the pad bytes before the ICRC.
    pad = (udp[9] >> 4) & 3
    dirty = []
    if udp[12] & 0x3F:
        dirty.append("BTH byte 4 reserved bits 0x%02x" % (udp[12] & 0x3F))
    if udp[16] & 0x7F:
        dirty.append("BTH byte 8 reserved bits 0x%02x" % (udp[16] & 0x7F))
    if udp[9] & 0x0F:
        dirty.append("transport version %d" % (udp[9] & 0x0F))
    if pad and any(udp[-4 - pad:-4]):
        dirty.append("non-zero pad bytes")
    if dirty:
        reserved_bad += 1
        if reserved_bad <= 5:
            print("   reserved fields not zero (psn 0x%06x): %s"
                  % (struct.unpack(">I", bytes(udp[16:20]))[0] & 0xFFFFFF, ", ".join(dirty)))
    hdr = bytearray(ip[:ihl])
    hdr[1] = 0xFF  # DSCP and ECN
    hdr[8] = 0xFF  # TTL
    hdr[10:12] = b"\xff\xff"  # header checksum
    u = bytearray(udp[:8])
    u[6:8] = b"\xff\xff"  # UDP checksum
    bth = bytearray(udp[8:20])
    bth[4] = 0xFF  # FECN, BECN, reserved
    rest = udp[20:-4]
    want = zlib.crc32(b"\xff" * 8 + bytes(hdr) + bytes(u) + bytes(bth) + rest) & 0xFFFFFFFF
    got = struct.unpack("<I", udp[-4:])[0]
    if want == got:
        good += 1
    else:
        bad += 1
        if bad <= 5:
            print("   bad ICRC: opcode %d psn 0x%06x: carried 0x%08x, computed 0x%08x"
                  % (bth[0], struct.unpack(">I", bytes(bth[8:12]))[0] & 0xFFFFFF, got, want))
print("   recomputed here from the captured bytes: %d packets, %d good, %d bad%s"
      % (total, good, bad, ", %d truncated (not checked)" % skipped if skipped else ""))
print("   IPv4 identification below 64: %d packets, %d not (%d were segments 1.. of a GSO send,"
      " i.e. had a non-zero identification)" % (id_ok, id_bad, segments))
print("   reserved fields: %d packets with a non-zero one" % reserved_bad)
if segments == 0:
    print("   no packet was a segment 1.. of a GSO send: the GSO path was not exercised")
sys.exit(1 if bad or id_bad or reserved_bad or segments == 0 or total == 0 else 0)
EOF
    echo "FAIL: ICRC, IPv4 identification, GSO or reserved-field check"
    status=1
  fi
else
  echo "   python3 not found: the ICRC is not recomputed"
fi

if [ "$status" -eq 0 ]; then
  echo "-- capture checks passed ($OUT)"
else
  echo "-- capture checks FAILED ($OUT)"
fi
exit "$status"
