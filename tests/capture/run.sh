#!/usr/bin/env bash
# Capture the RoCE v2 traffic of a short roccl-perf run on loopback and check it with tshark
# (scripts/capture.sh: InfiniBand decoding, no malformed packets, ICRC, IPv4 id and DF).
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
scripts/capture.sh "$tmp/roccl-rocev2.pcapng" || status=$?
exit "$status"
