//! Strangers for the tests of issue 22: what a process that reaches a rank's ports without
//! belonging to the job can send, and where this process listens.

use std::collections::HashSet;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The socket inodes of this process's descriptors.
pub fn own_socket_inodes() -> HashSet<u64> {
    let mut out = HashSet::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if let Ok(t) = std::fs::read_link(e.path()) {
            let t = t.to_string_lossy().to_string();
            if let Some(n) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                out.insert(n.parse().unwrap());
            }
        }
    }
    out
}

/// An address of `/proc/net/tcp` (`0100007F:1F90`; `tcp6`: four little-endian words).
pub fn proc_addr(a: &str) -> SocketAddr {
    let (ip, port) = a.split_once(':').unwrap();
    let port = u16::from_str_radix(port, 16).unwrap();
    let bytes: Vec<u8> = (0..ip.len() / 2)
        .map(|i| u8::from_str_radix(&ip[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let ip: std::net::IpAddr = if bytes.len() == 4 {
        let v = [bytes[3], bytes[2], bytes[1], bytes[0]];
        if v == [0; 4] {
            [127, 0, 0, 1].into()
        } else {
            v.into()
        }
    } else {
        let mut v = [0u8; 16];
        for w in 0..4 {
            for k in 0..4 {
                v[4 * w + k] = bytes[4 * w + 3 - k];
            }
        }
        let v6 = std::net::Ipv6Addr::from(v);
        match v6.to_ipv4_mapped() {
            Some(v4) if !v4.is_unspecified() => v4.into(),
            _ if v6.is_unspecified() => [127, 0, 0, 1].into(),
            _ => v6.into(),
        }
    };
    SocketAddr::new(ip, port)
}

/// Every TCP address this process listens on (IPv4 and IPv6; a wildcard as loopback).
pub fn listening_ports() -> Vec<SocketAddr> {
    sockets_of(&["/proc/self/net/tcp", "/proc/self/net/tcp6"], "0A")
}

/// Every UDP address this process has bound (IPv4 and IPv6; a wildcard as loopback).
pub fn udp_ports() -> Vec<SocketAddr> {
    sockets_of(&["/proc/self/net/udp", "/proc/self/net/udp6"], "07")
}

/// The local addresses of this process's sockets in `files` (`/proc/net/...`) in `state`.
fn sockets_of(files: &[&str], state: &str) -> Vec<SocketAddr> {
    let mine = own_socket_inodes();
    let mut ports = Vec::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 10 || w[3] != state {
                continue;
            }
            let inode: u64 = w[9].parse().unwrap_or(0);
            if !mine.contains(&inode) {
                continue;
            }
            ports.push(proc_addr(w[1]));
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Bytes from a small generator (the test's own, not cryptographic).
pub fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What a stranger of [`strangers_of_kinds_at`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stranger {
    /// Sends random bytes (more than any listener's first message).
    Garbage,
    /// Sends nothing.
    Idle,
    /// Sends the first bytes of a plausible message and stops.
    Half,
}

/// Strangers at `port`: three connections that send random bytes, one idle connection, and
/// one that sends half of a plausible message and stops. Returns the connections still
/// open (they stay so while the job runs).
pub fn strangers_at(at: SocketAddr, seed: u64) -> Vec<TcpStream> {
    strangers_of_kinds_at(at, seed)
        .into_iter()
        .map(|(_, s)| s)
        .collect()
}

/// [`strangers_at`], each with what it does.
pub fn strangers_of_kinds_at(at: SocketAddr, seed: u64) -> Vec<(Stranger, TcpStream)> {
    let mut keep = Vec::new();
    for k in 0..3 {
        if let Ok(mut s) = TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
            let _ = s.write_all(&noise(seed + k, 200 + 100 * k as usize));
            keep.push((Stranger::Garbage, s));
        }
    }
    if let Ok(s) = TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
        keep.push((Stranger::Idle, s));
    }
    if let Ok(mut s) = TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
        // The first bytes of a registration / TCP hello / RoCE setup message.
        let _ = s.write_all(&[0x52, 0x42, 0x53, 0x32, 1, 2, 3]);
        keep.push((Stranger::Half, s));
    }
    keep
}

/// The remote addresses of this process's TCP sockets that are connected (or whose peer
/// has closed and which are still open).
pub fn peers_of_own_sockets() -> Vec<SocketAddr> {
    own_connections()
        .into_iter()
        .map(|(_, peer)| peer)
        .collect()
}

/// (local, remote) addresses of this process's TCP sockets that are connected (or whose
/// peer has closed and which are still open).
pub fn own_connections() -> Vec<(SocketAddr, SocketAddr)> {
    let mine = own_socket_inodes();
    let mut out = Vec::new();
    for f in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let w: Vec<&str> = line.split_whitespace().collect();
            // 01 ESTABLISHED, 08 CLOSE_WAIT.
            if w.len() < 10 || !(w[3] == "01" || w[3] == "08") {
                continue;
            }
            if mine.contains(&w[9].parse().unwrap_or(0)) {
                out.push((proc_addr(w[1]), proc_addr(w[2])));
            }
        }
    }
    out
}
