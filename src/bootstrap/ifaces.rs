//! Choosing the local network interface roccl listens on, like `NCCL_SOCKET_IFNAME`.
//!
//! Two environment variables steer the choice:
//!
//! - `ROCCL_SOCKET_IFNAME`: which interfaces may be used, in the same syntax as
//!   `NCCL_SOCKET_IFNAME` (see [`select`]);
//! - `ROCCL_SOCKET_FAMILY`: `AF_INET`/`ipv4` or `AF_INET6`/`ipv6` to restrict the address
//!   family (see [`parse_family`]); by default both are allowed, IPv4 first.
//!
//! Without `ROCCL_SOCKET_IFNAME`, loopback, Docker and virtual-bridge interfaces are avoided
//! unless nothing else exists, and a rank that knows where the root is picks the interface the
//! kernel would route through to reach it (see [`local_addr`]).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use crate::error::{Error, Result};

/// Environment variable naming the interfaces roccl may use.
const IFNAME_VAR: &str = "ROCCL_SOCKET_IFNAME";
/// Environment variable restricting the address family.
const FAMILY_VAR: &str = "ROCCL_SOCKET_FAMILY";

/// Interface name prefixes skipped by the default policy (no `ROCCL_SOCKET_IFNAME`):
/// loopback, Docker (`docker0`, `br-<id>`, `veth*`), libvirt and container-network bridges.
const DEFAULT_EXCLUDE: &[&str] = &["lo", "docker", "virbr", "veth", "br-", "cni", "flannel"];

/// One local interface address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// One address assigned to it (an interface with several addresses appears several times).
    pub addr: IpAddr,
    /// Its prefix length (bits of the netmask): the subnet it reaches without a router.
    pub prefix: u8,
}

impl fmt::Display for Iface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.name, self.addr)
    }
}

/// Address family preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Both families; IPv4 addresses are preferred over IPv6 ones.
    Any,
    /// IPv4 only.
    V4,
    /// IPv6 only.
    V6,
}

impl Family {
    /// Whether `addr` belongs to this family.
    fn admits(self, addr: &IpAddr) -> bool {
        match self {
            Family::Any => true,
            Family::V4 => addr.is_ipv4(),
            Family::V6 => addr.is_ipv6(),
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Any => "any",
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Parse a `ROCCL_SOCKET_FAMILY` value (case-insensitive, surrounding blanks ignored).
///
/// Accepted: `AF_INET`, `ipv4`, `inet`, `v4`, `4` for IPv4; `AF_INET6`, `ipv6`, `inet6`, `v6`,
/// `6` for IPv6; `any`, `AF_UNSPEC` or an empty string for both. Anything else is an
/// [`Error::InvalidArgument`] listing the valid values.
pub fn parse_family(s: &str) -> Result<Family> {
    match s.trim().to_ascii_lowercase().as_str() {
        "af_inet" | "ipv4" | "inet" | "v4" | "4" => Ok(Family::V4),
        "af_inet6" | "ipv6" | "inet6" | "v6" | "6" => Ok(Family::V6),
        "" | "any" | "af_unspec" => Ok(Family::Any),
        _ => Err(Error::arg(format!(
            "{FAMILY_VAR}={s:?} is not an address family; valid values: \
             AF_INET or ipv4, AF_INET6 or ipv6, any"
        ))),
    }
}

/// Whether `addr` is an IPv6 link-local address (`fe80::/10`).
fn is_v6_link_local(addr: &IpAddr) -> bool {
    matches!(addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80)
}

/// Owns the list returned by `getifaddrs` and frees it when dropped, on every path.
struct IfAddrs(*mut libc::ifaddrs);

impl Drop for IfAddrs {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: self.0 was returned by a successful getifaddrs call, is not used after
            // this point and is freed exactly once (this value owns it).
            unsafe { libc::freeifaddrs(self.0) };
        }
    }
}

/// Read one entry's address, if it is IPv4 or IPv6.
///
/// # Safety
/// `sa` must be null or point to a valid socket address of the size implied by its family, as
/// the entries of a live `getifaddrs` list do.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: sa is non-null and valid per this function's contract; every sockaddr starts with
    // its family field. read_unaligned avoids assuming any alignment.
    let family = unsafe { std::ptr::read_unaligned(sa) }.sa_family;
    match i32::from(family) {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in, which the contract makes readable.
            let sin = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            // s_addr holds the address in network byte order, i.e. its bytes in memory order.
            Some(IpAddr::V4(Ipv4Addr::from(
                sin.sin_addr.s_addr.to_ne_bytes(),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6, which the contract makes readable.
            let sin6 = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// All addresses of interfaces that are up (`IFF_UP`), IPv4 and IPv6, in the order the kernel
/// lists them, without duplicates.
///
/// Point-to-point interfaces (VPN tunnels, PPP) are kept. IPv6 link-local addresses
/// (`fe80::/10`) are left out, since they cannot be reached without a scope id, unless there is
/// no other address at all.
pub fn list() -> Result<Vec<Iface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs only writes the list head through the valid pointer it is given.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::last_os("getifaddrs: listing network interfaces"));
    }
    let list = IfAddrs(head);

    let mut found: Vec<Iface> = Vec::new();
    let mut link_local: Vec<Iface> = Vec::new();
    let mut cur = list.0.cast_const();
    while !cur.is_null() {
        // SAFETY: cur is a non-null node of the list owned by `list`, alive until it drops.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next.cast_const();
        if ifa.ifa_flags & (libc::IFF_UP as libc::c_uint) == 0 || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is null or points to a socket address sized for its family, owned
        // by the live list.
        let Some(addr) = (unsafe { sockaddr_ip(ifa.ifa_addr) }) else {
            continue;
        };
        // SAFETY: ifa_name is a non-null, NUL-terminated string owned by the live list; it is
        // copied before the list is freed.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_netmask is null or a socket address of the interface's family, owned
        // by the live list.
        let prefix = match unsafe { sockaddr_ip(ifa.ifa_netmask) } {
            Some(IpAddr::V4(m)) => m.to_bits().count_ones() as u8,
            Some(IpAddr::V6(m)) => m.to_bits().count_ones() as u8,
            None => full_prefix(&addr),
        };
        let iface = Iface { name, addr, prefix };
        let dest = if is_v6_link_local(&addr) {
            &mut link_local
        } else {
            &mut found
        };
        if !dest.contains(&iface) {
            dest.push(iface);
        }
    }
    drop(list);

    if found.is_empty() {
        found = link_local;
    }
    Ok(found)
}

/// The prefix of a single address of `a`'s family (32 or 128).
fn full_prefix(a: &IpAddr) -> u8 {
    if a.is_ipv4() {
        32
    } else {
        128
    }
}

/// Whether `a` is on the subnet of `iface`: same family, the first `prefix` bits equal.
pub fn on_subnet(iface: &Iface, a: IpAddr) -> bool {
    match (iface.addr, a) {
        (IpAddr::V4(x), IpAddr::V4(y)) => {
            let p = u32::from(iface.prefix.min(32));
            let m = u32::MAX.checked_shl(32 - p).unwrap_or(0);
            x.to_bits() & m == y.to_bits() & m
        }
        (IpAddr::V6(x), IpAddr::V6(y)) => {
            let p = u32::from(iface.prefix.min(128));
            let m = u128::MAX.checked_shl(128 - p).unwrap_or(0);
            x.to_bits() & m == y.to_bits() & m
        }
        _ => false,
    }
}

/// Which of `candidates` (the addresses a peer published, its preferred first) to reach it
/// by: the first on the subnet of one of `local`'s interfaces (a peer at the other end of a
/// cable of a switchless mesh, or on the same LAN), else the first the kernel has a route
/// to (`routed`), else the first. Returns its index.
pub fn pick_reachable(
    candidates: &[IpAddr],
    local: &[Iface],
    routed: impl Fn(IpAddr) -> bool,
) -> usize {
    let usable = |i: &&Iface| !i.addr.is_loopback() || candidates.iter().any(IpAddr::is_loopback);
    // The longest matching prefix wins (the earlier candidate on a tie): a /30 per cable
    // over a /16 that several share.
    let mut best: Option<(usize, u8)> = None;
    for (k, &c) in candidates.iter().enumerate() {
        let p = local
            .iter()
            .filter(usable)
            .filter(|i| on_subnet(i, c))
            .map(|i| i.prefix)
            .max();
        if let Some(p) = p {
            if best.map_or(true, |(_, b)| p > b) {
                best = Some((k, p));
            }
        }
    }
    best.map(|(k, _)| k)
        .or_else(|| candidates.iter().position(|&c| routed(c)))
        .unwrap_or(0)
}

/// [`pick_reachable`] with this host's interfaces and routing table.
pub fn reachable(candidates: &[IpAddr]) -> usize {
    if candidates.len() < 2 {
        return 0;
    }
    let local = list().unwrap_or_default();
    pick_reachable(candidates, &local, |c| route_source(c).is_some())
}

/// Of `primary` and `others` (a peer's main address and its others), the one this host
/// reaches it at ([`reachable`]).
pub fn reach(primary: IpAddr, others: &[Ipv4Addr]) -> IpAddr {
    if others.is_empty() {
        return primary;
    }
    let all: Vec<IpAddr> = std::iter::once(primary)
        .chain(others.iter().map(|&a| IpAddr::V4(a)))
        .collect();
    all[reachable(&all)]
}

/// Write `others` (at most `max`; the rest are left out) into a handle: their count at
/// `b[count_at]`, the addresses from `b[at]`, 4 bytes each.
pub fn put_others(b: &mut [u8], count_at: usize, at: usize, others: &[Ipv4Addr], max: usize) {
    let others = &others[..others.len().min(max)];
    b[count_at] = others.len() as u8;
    for (i, a) in others.iter().enumerate() {
        b[at + 4 * i..at + 4 * i + 4].copy_from_slice(&a.octets());
    }
}

/// The addresses [`put_others`] wrote; `None` when the count is above `max`.
pub fn get_others(b: &[u8], count_at: usize, at: usize, max: usize) -> Option<Vec<Ipv4Addr>> {
    let n = b[count_at] as usize;
    (n <= max).then(|| {
        (0..n)
            .map(|i| Ipv4Addr::from(<[u8; 4]>::try_from(&b[at + 4 * i..at + 4 * i + 4]).unwrap()))
            .collect()
    })
}

/// The IPv4 addresses this host publishes beside `primary` (at most `max`): those of the
/// other interfaces that `ROCCL_SOCKET_IFNAME` / `ROCCL_SOCKET_FAMILY` select, so that a
/// peer that cannot reach `primary` (a switchless mesh, each cable its own subnet) reaches
/// one of them. Only where `ROCCL_SOCKET_IFNAME` is set (the interfaces named are the ones
/// to use): by default a rank publishes one address, so that a routed data network is not
/// traded for a management LAN that happens to share a subnet. None when `primary` is a
/// loopback or IPv6 address.
pub fn other_addrs(primary: IpAddr, max: usize) -> Vec<Ipv4Addr> {
    if primary.is_loopback() || !primary.is_ipv4() {
        return Vec::new();
    }
    let Some(spec) = env_var(IFNAME_VAR) else {
        return Vec::new();
    };
    let spec = Some(spec);
    let family = env_var(FAMILY_VAR)
        .and_then(|v| parse_family(&v).ok())
        .unwrap_or(Family::Any);
    let all = list().unwrap_or_default();
    let mut out = Vec::new();
    for i in select(&all, spec.as_deref(), family) {
        if let IpAddr::V4(v) = i.addr {
            if i.addr != primary && !is_loopback(&i) && !out.contains(&v) && out.len() < max {
                out.push(v);
            }
        }
    }
    out
}

/// Whether `iface` is a loopback interface (by name or by address).
fn is_loopback(iface: &Iface) -> bool {
    iface.name.starts_with("lo") || iface.addr.is_loopback()
}

/// A `ROCCL_SOCKET_IFNAME` value as NCCL reads `NCCL_SOCKET_IFNAME`: `^` excludes the names
/// listed, `=` takes them exactly rather than as prefixes, names are separated by commas.
struct NameSpec<'a> {
    exclude: bool,
    exact: bool,
    list: Vec<&'a str>,
}

impl<'a> NameSpec<'a> {
    fn parse(spec: &'a str) -> NameSpec<'a> {
        let spec = spec.trim();
        let (exclude, rest) = match spec.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, spec),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let list = rest
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        NameSpec {
            exclude,
            exact,
            list,
        }
    }

    /// Whether the list names `name` (an exclusion's list too).
    fn names(&self, name: &str) -> bool {
        self.list.iter().any(|n| {
            if self.exact {
                name == *n
            } else {
                name.starts_with(n)
            }
        })
    }
}

/// Filter `all` by a `NCCL_SOCKET_IFNAME`-style spec and an address family.
///
/// The spec is a comma-separated list of interface names (blanks around items ignored):
///
/// - `eth,ens`: interfaces whose name starts with one of the prefixes;
/// - `^docker,lo`: a leading `^` excludes the listed prefixes and keeps everything else;
/// - `=eth0,ib0`: a leading `=` matches the listed names exactly;
/// - `^=docker0`: exact-name exclusion.
///
/// `None` (or a blank spec) means the default policy: skip loopback (`lo*` or a loopback
/// address), Docker (`docker*`, `br-*`, `veth*`), libvirt (`virbr*`) and CNI/flannel bridges.
/// If that leaves nothing, loopback interfaces are used; if there are none either, every
/// interface of the family is returned.
///
/// The kernel's order is preserved within each family; with [`Family::Any`] all IPv4
/// addresses come before all IPv6 ones, [`Family::V4`] / [`Family::V6`] keep only that family.
pub fn select(all: &[Iface], spec: Option<&str>, family: Family) -> Vec<Iface> {
    let of_family: Vec<&Iface> = all.iter().filter(|i| family.admits(&i.addr)).collect();
    let chosen: Vec<&Iface> = match spec.map(str::trim).filter(|s| !s.is_empty()) {
        Some(spec) => {
            let spec = NameSpec::parse(spec);
            let (exclude, listed) = (spec.exclude, |i: &Iface| spec.names(&i.name));
            of_family
                .into_iter()
                .filter(|i| listed(i) != exclude)
                .collect()
        }
        None => {
            let excluded =
                |i: &Iface| is_loopback(i) || DEFAULT_EXCLUDE.iter().any(|p| i.name.starts_with(p));
            let preferred: Vec<&Iface> =
                of_family.iter().copied().filter(|i| !excluded(i)).collect();
            if !preferred.is_empty() {
                preferred
            } else {
                let loopback: Vec<&Iface> = of_family
                    .iter()
                    .copied()
                    .filter(|i| is_loopback(i))
                    .collect();
                if loopback.is_empty() {
                    of_family
                } else {
                    loopback
                }
            }
        }
    };
    let mut out: Vec<Iface> = chosen.into_iter().cloned().collect();
    // Stable: keeps the kernel's order within each family.
    out.sort_by_key(|i| i.addr.is_ipv6());
    out
}

/// The source address the kernel would use to reach `remote`: connecting a UDP socket only
/// consults the routing table, it sends no packet.
pub fn route_source(remote: IpAddr) -> Option<IpAddr> {
    let bind: SocketAddr = match remote {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(bind).ok()?;
    // Port 9 (discard); any non-zero port works, nothing is sent.
    sock.connect((remote, 9)).ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// Read a variable, treating unset, non-Unicode and blank values alike as absent.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The local address roccl should listen on (and advertise to peers).
///
/// Reads `ROCCL_SOCKET_IFNAME` and `ROCCL_SOCKET_FAMILY`, lists the interfaces ([`list`]),
/// filters them ([`select`]) and returns the first address left.
///
/// If `toward` is `Some(remote)` and `ROCCL_SOCKET_IFNAME` is not set, the address the kernel
/// would use as source to reach `remote` is preferred when it belongs to a listed interface
/// of the allowed family: this is how a non-root rank picks the interface that reaches the root
/// (even loopback, when the root is on `127.0.0.1`). No packet is sent.
///
/// Errors: an invalid `ROCCL_SOCKET_FAMILY`, a failing `getifaddrs`, or no interface left, as
/// an [`Error::InvalidArgument`] naming the spec and listing the interfaces that exist, e.g.
/// `ROCCL_SOCKET_IFNAME=eth9 matches no interface; available: lo 127.0.0.1, eth0 10.0.0.2`.
pub fn local_addr(toward: Option<IpAddr>) -> Result<IpAddr> {
    let spec = env_var(IFNAME_VAR);
    let family = match env_var(FAMILY_VAR) {
        Some(v) => parse_family(&v)?,
        None => Family::Any,
    };
    let all = list()?;
    let routed = match (&spec, toward) {
        (None, Some(remote)) => route_source(remote),
        _ => None,
    };
    choose(&all, spec.as_deref(), family, routed).map_err(|e| match (e, spec.as_deref()) {
        (Error::InvalidArgument(m), Some(s)) => match down_named(s, &all) {
            Some(names) => Error::arg(format!(
                "{m}; {names} exists but is down or has no address (its link, a cable, a \
                 switch port): bring it up, or name another interface"
            )),
            None => Error::InvalidArgument(m),
        },
        (e, _) => e,
    })
}

/// The interfaces of this host (`/sys/class/net`) that `spec` names (its exact `=name`s and
/// prefixes, not its `^` exclusions) and that have no address up (not in `up`), joined by
/// commas; `None` when there is none.
fn down_named(spec: &str, up: &[Iface]) -> Option<String> {
    let spec = NameSpec::parse(spec);
    if spec.exclude {
        return None;
    }
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| spec.names(n))
        .filter(|n| !up.iter().any(|i| &i.name == n))
        .collect();
    names.sort();
    (!names.is_empty()).then(|| names.join(", "))
}

/// The decision behind [`local_addr`], given the interfaces, the settings and the kernel's
/// route source (if one was looked up).
fn choose(
    all: &[Iface],
    spec: Option<&str>,
    family: Family,
    routed: Option<IpAddr>,
) -> Result<IpAddr> {
    if let Some(ip) = routed {
        if family.admits(&ip) && all.iter().any(|i| i.addr == ip) {
            return Ok(ip);
        }
    }
    if let Some(first) = select(all, spec, family).first() {
        return Ok(first.addr);
    }
    let available = if all.is_empty() {
        "none".to_string()
    } else {
        all.iter()
            .map(Iface::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let what = match family {
        Family::Any => "interface".to_string(),
        f => format!("{f} interface ({FAMILY_VAR})"),
    };
    let msg = match spec.map(str::trim).filter(|s| !s.is_empty()) {
        Some(s) => format!("{IFNAME_VAR}={s} matches no {what}; available: {available}"),
        None => format!(
            "no usable network {what} found; available: {available}; \
             set {IFNAME_VAR} and/or {FAMILY_VAR}"
        ),
    };
    Err(Error::arg(msg))
}

/// Write `a` into the 20 bytes `b[..20]`: family (4 or 6), a zero byte, the port
/// (little-endian) and the address (16 bytes; 4 used for IPv4). The form addresses take in
/// connection handles and rendezvous blobs.
pub fn put_addr(b: &mut [u8], a: SocketAddr) {
    match a.ip() {
        IpAddr::V4(v) => {
            b[0] = 4;
            b[4..8].copy_from_slice(&v.octets());
        }
        IpAddr::V6(v) => {
            b[0] = 6;
            b[4..20].copy_from_slice(&v.octets());
        }
    }
    b[2..4].copy_from_slice(&a.port().to_le_bytes());
}

/// The address [`put_addr`] wrote, or `None` (no address, an unknown family, fewer than
/// 20 bytes).
pub fn get_addr(b: &[u8]) -> Option<SocketAddr> {
    if b.len() < 20 {
        return None;
    }
    let ip: IpAddr = match b[0] {
        4 => <[u8; 4]>::try_from(&b[4..8]).ok()?.into(),
        6 => <[u8; 16]>::try_from(&b[4..20]).ok()?.into(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_le_bytes([b[2], b[3]])))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifc(name: &str, addr: &str) -> Iface {
        Iface {
            name: name.to_string(),
            addr: addr.parse().unwrap(),
            prefix: 24,
        }
    }

    fn sample() -> Vec<Iface> {
        vec![
            ifc("lo", "127.0.0.1"),
            ifc("eth0", "10.0.0.2"),
            ifc("docker0", "172.17.0.1"),
            ifc("ens1f0", "192.168.1.5"),
            ifc("eth0", "2001:db8::2"),
            ifc("lo", "::1"),
            ifc("eth10", "10.1.0.2"),
            ifc("virbr0", "192.168.122.1"),
            ifc("br-1234abcd", "172.18.0.1"),
        ]
    }

    fn names(v: &[Iface]) -> Vec<String> {
        v.iter().map(|i| format!("{} {}", i.name, i.addr)).collect()
    }

    #[test]
    fn prefix_spec() {
        let got = select(&sample(), Some("eth"), Family::Any);
        assert_eq!(
            names(&got),
            ["eth0 10.0.0.2", "eth10 10.1.0.2", "eth0 2001:db8::2"]
        );
        let got = select(&sample(), Some(" ens , eth1 "), Family::Any);
        assert_eq!(names(&got), ["ens1f0 192.168.1.5", "eth10 10.1.0.2"]);
        // A prefix can select loopback explicitly.
        let got = select(&sample(), Some("lo"), Family::Any);
        assert_eq!(names(&got), ["lo 127.0.0.1", "lo ::1"]);
    }

    #[test]
    fn exclusion_spec() {
        let got = select(&sample(), Some("^docker,lo,virbr,br-"), Family::Any);
        assert_eq!(
            names(&got),
            [
                "eth0 10.0.0.2",
                "ens1f0 192.168.1.5",
                "eth10 10.1.0.2",
                "eth0 2001:db8::2"
            ]
        );
        // Prefix exclusion: "eth" removes eth0 and eth10.
        let got = select(&sample(), Some("^eth,lo,docker,virbr,br"), Family::V4);
        assert_eq!(names(&got), ["ens1f0 192.168.1.5"]);
    }

    #[test]
    fn exact_spec() {
        let got = select(&sample(), Some("=eth0"), Family::Any);
        assert_eq!(names(&got), ["eth0 10.0.0.2", "eth0 2001:db8::2"]);
        let got = select(&sample(), Some("=eth"), Family::Any);
        assert!(got.is_empty());
        let got = select(&sample(), Some("=eth10,ens1f0"), Family::Any);
        assert_eq!(names(&got), ["ens1f0 192.168.1.5", "eth10 10.1.0.2"]);
    }

    #[test]
    fn exact_exclusion_spec() {
        let got = select(
            &sample(),
            Some("^=eth0,lo,docker0,virbr0,br-1234abcd"),
            Family::Any,
        );
        assert_eq!(names(&got), ["ens1f0 192.168.1.5", "eth10 10.1.0.2"]);
    }

    #[test]
    fn default_policy() {
        for spec in [None, Some(""), Some("  ")] {
            let got = select(&sample(), spec, Family::Any);
            assert_eq!(
                names(&got),
                [
                    "eth0 10.0.0.2",
                    "ens1f0 192.168.1.5",
                    "eth10 10.1.0.2",
                    "eth0 2001:db8::2"
                ]
            );
        }
    }

    #[test]
    fn default_policy_falls_back_to_loopback() {
        let all = vec![
            ifc("docker0", "172.17.0.1"),
            ifc("lo", "127.0.0.1"),
            ifc("lo", "::1"),
            ifc("veth12", "169.254.3.3"),
        ];
        let got = select(&all, None, Family::Any);
        assert_eq!(names(&got), ["lo 127.0.0.1", "lo ::1"]);
        let got = select(&all, None, Family::V6);
        assert_eq!(names(&got), ["lo ::1"]);
        // Neither a preferred nor a loopback interface: use what there is.
        let only_docker = vec![ifc("docker0", "172.17.0.1")];
        assert_eq!(select(&only_docker, None, Family::Any), only_docker);
        assert!(select(&[], None, Family::Any).is_empty());
    }

    #[test]
    fn family_filtering_and_order() {
        let all = vec![
            ifc("eth0", "2001:db8::2"),
            ifc("eth0", "10.0.0.2"),
            ifc("eth1", "2001:db8::3"),
            ifc("eth1", "10.0.0.3"),
        ];
        let got = select(&all, None, Family::Any);
        assert_eq!(
            names(&got),
            [
                "eth0 10.0.0.2",
                "eth1 10.0.0.3",
                "eth0 2001:db8::2",
                "eth1 2001:db8::3"
            ]
        );
        let got = select(&all, Some("eth"), Family::V6);
        assert_eq!(names(&got), ["eth0 2001:db8::2", "eth1 2001:db8::3"]);
        let got = select(&all, Some("^eth0"), Family::V4);
        assert_eq!(names(&got), ["eth1 10.0.0.3"]);
    }

    #[test]
    fn family_parsing() {
        for s in ["AF_INET", "af_inet", "ipv4", "IPv4", " inet ", "v4", "4"] {
            assert_eq!(parse_family(s).unwrap(), Family::V4, "{s}");
        }
        for s in ["AF_INET6", "ipv6", "IPV6", "inet6", "v6", "6"] {
            assert_eq!(parse_family(s).unwrap(), Family::V6, "{s}");
        }
        for s in ["", "any", "ANY", "AF_UNSPEC"] {
            assert_eq!(parse_family(s).unwrap(), Family::Any, "{s}");
        }
        let err = parse_family("ipx").unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        let msg = err.to_string();
        assert!(msg.contains("ROCCL_SOCKET_FAMILY"), "{msg}");
        assert!(msg.contains("ipx"), "{msg}");
        assert!(msg.contains("AF_INET6") && msg.contains("ipv4"), "{msg}");
    }

    #[test]
    fn choose_prefers_route_unless_spec() {
        let all = sample();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let ens: IpAddr = "192.168.1.5".parse().unwrap();
        let eth0: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(choose(&all, None, Family::Any, Some(lo)).unwrap(), lo);
        assert_eq!(choose(&all, None, Family::Any, Some(ens)).unwrap(), ens);
        assert_eq!(choose(&all, None, Family::Any, None).unwrap(), eth0);
        // A route source that is not a local interface, or of the wrong family, is ignored.
        let foreign: IpAddr = "10.9.9.9".parse().unwrap();
        assert_eq!(
            choose(&all, None, Family::Any, Some(foreign)).unwrap(),
            eth0
        );
        let v6: IpAddr = "2001:db8::2".parse().unwrap();
        assert_eq!(choose(&all, None, Family::V4, Some(v6)).unwrap(), eth0);
        assert_eq!(choose(&all, None, Family::V6, None).unwrap(), v6);
        assert_eq!(choose(&all, Some("ens"), Family::Any, None).unwrap(), ens);
    }

    #[test]
    fn choose_errors_name_spec_and_list_interfaces() {
        let all = vec![ifc("lo", "127.0.0.1"), ifc("eth0", "10.0.0.2")];
        let err = choose(&all, Some("eth9"), Family::Any, None).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        let msg = err.to_string();
        assert!(
            msg.contains(
                "ROCCL_SOCKET_IFNAME=eth9 matches no interface; \
                 available: lo 127.0.0.1, eth0 10.0.0.2"
            ),
            "{msg}"
        );
        let msg = choose(&all, Some("eth"), Family::V6, None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("no IPv6 interface"), "{msg}");
        assert!(msg.contains("ROCCL_SOCKET_FAMILY"), "{msg}");
        let msg = choose(&all, None, Family::V6, None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("no usable network IPv6 interface"), "{msg}");
        let msg = choose(&[], None, Family::Any, None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("available: none"), "{msg}");
    }

    #[test]
    fn link_local_detection() {
        assert!(is_v6_link_local(&"fe80::1".parse().unwrap()));
        assert!(is_v6_link_local(&"febf::1".parse().unwrap()));
        assert!(!is_v6_link_local(&"fec0::1".parse().unwrap()));
        assert!(!is_v6_link_local(&"::1".parse().unwrap()));
        assert!(!is_v6_link_local(&"169.254.0.1".parse().unwrap()));
    }

    #[test]
    fn list_has_loopback() {
        let all = list().unwrap();
        assert!(
            all.iter().any(|i| i.addr.is_loopback()),
            "no loopback address in {all:?}"
        );
        assert!(all.iter().all(|i| !i.name.is_empty()));
    }

    /// An interface the setting names that exists but has no address up is named as such
    /// (a link down as a rank starts), not only "matches no interface".
    #[test]
    fn a_named_interface_without_an_address_up_is_called_down() {
        let up = list().unwrap();
        // `lo` exists on every Linux host: "down" when the addresses up do not include it.
        assert_eq!(down_named("=lo", &[]).as_deref(), Some("lo"));
        assert_eq!(down_named("lo", &[]).as_deref(), Some("lo"));
        assert_eq!(down_named("=lo", &up), None, "lo is up: {up:?}");
        assert_eq!(down_named("^lo", &[]), None, "an exclusion names nothing");
        assert_eq!(down_named("=roccl-no-such-if", &[]), None);
    }

    #[test]
    fn route_to_loopback_is_loopback() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        assert_eq!(route_source(lo), Some(lo));
        let all = list().unwrap();
        assert_eq!(
            choose(&all, None, Family::Any, route_source(lo)).unwrap(),
            lo
        );
        if env_var(IFNAME_VAR).is_none() && env_var(FAMILY_VAR).is_none() {
            assert_eq!(local_addr(Some(lo)).unwrap(), lo);
            assert!(local_addr(None).is_ok());
        }
    }

    #[test]
    fn a_peer_is_reached_on_the_subnet_of_the_cable_that_leads_to_it() {
        // Host 1 of a switchless mesh: cables to host 0 (10.81.1.0/24) and host 2
        // (10.81.3.0/24), loopback, no routes beyond the cables' subnets.
        let host1 = [
            Iface {
                prefix: 8,
                ..ifc("lo", "127.0.0.1")
            },
            ifc("to0", "10.81.1.2"),
            ifc("to2", "10.81.3.1"),
        ];
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let no_route = |_: IpAddr| false;
        // Host 0 published its cable to host 2 first, then its cable to host 1.
        let host0 = [ip("10.81.2.1"), ip("10.81.1.1")];
        assert_eq!(pick_reachable(&host0, &host1, no_route), 1);
        // Host 2 published the cable to host 1 second too.
        let host2 = [ip("10.81.2.2"), ip("10.81.3.2")];
        assert_eq!(pick_reachable(&host2, &host1, no_route), 1);
        // Off every subnet: the first the kernel routes to, else the first.
        let far = [ip("192.0.2.1"), ip("198.51.100.1")];
        assert_eq!(pick_reachable(&far, &host1, |c| c == ip("198.51.100.1")), 1);
        assert_eq!(pick_reachable(&far, &host1, no_route), 0);
        // Loopback's /8 does not claim a peer's addresses, and a /32 only its own.
        assert!(!on_subnet(&host1[0], ip("10.81.1.1")));
        let own = Iface {
            prefix: 32,
            ..ifc("lo", "10.80.0.2")
        };
        assert!(on_subnet(&own, ip("10.80.0.2")) && !on_subnet(&own, ip("10.80.0.1")));
        assert!(on_subnet(
            &Iface {
                prefix: 0,
                ..ifc("x", "1.2.3.4")
            },
            ip("9.9.9.9")
        ));
        let v6 = Iface {
            prefix: 64,
            ..ifc("x", "fd00:1::1")
        };
        assert!(on_subnet(&v6, ip("fd00:1::2")) && !on_subnet(&v6, ip("fd00:2::1")));
        assert!(!on_subnet(&v6, ip("10.81.1.1")));
        // A cable's /30 beats a /16 that another interface has.
        let wide = [
            Iface {
                prefix: 16,
                ..ifc("lan", "10.81.200.1")
            },
            Iface {
                prefix: 30,
                ..ifc("tb0", "10.81.4.1")
            },
        ];
        assert_eq!(
            pick_reachable(&[ip("10.81.7.9"), ip("10.81.4.2")], &wide, no_route),
            1
        );
    }
}
