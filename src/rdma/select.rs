//! Choosing the RDMA device, port and GID for RoCE v2, from sysfs alone.
//!
//! The kernel describes every RDMA device under `/sys/class/infiniband/<dev>/`:
//!
//! - `ports/<port>/state` (`4: ACTIVE`, `1: DOWN`, ...), `ports/<port>/link_layer`
//!   (`Ethernet` for RoCE, `InfiniBand`) and `ports/<port>/rate` (`100 Gb/sec (4X EDR)`);
//! - `ports/<port>/gids/<index>`: the GID table, each entry an IPv6-format address
//!   (`0000:0000:0000:0000:0000:ffff:c0a8:0102` is the IPv4-mapped `192.168.1.2`, `fe80:...`
//!   a link-local address, all zeros an unused slot);
//! - `ports/<port>/gid_attrs/types/<index>` (`RoCE v2` or `IB/RoCE v1`) and
//!   `ports/<port>/gid_attrs/ndevs/<index>` (the netdev the address belongs to);
//! - `node_guid`, and `device`, a symlink to the PCI function (`.../0000:17:00.0`).
//!
//! A RoCE v2 NIC lists each address of its netdev twice or once (ConnectX: one RoCE v1 and one
//! RoCE v2 entry per address; Intel E810/irdma: RoCE v2 only), plus link-local entries. The
//! right GID is the RoCE v2 entry of a routable address, which [`choose`] finds; [`scan`] reads
//! the tables, [`describe`] prints them. Every function takes the sysfs root as a parameter
//! so that tests run against fake trees (`tests/data/sysfs/`).
//!
//! Inside containers, reading some GID entries fails (`EINVAL`): [`scan`] records any entry
//! whose address or type cannot be read in [`PortInfo::unreadable`] and goes on.
//!
//! Environment variables (read by [`Criteria::from_env`]):
//!
//! - `ROCCL_IB_HCA`: which devices/ports may be used, in `NCCL_IB_HCA` syntax ([`parse_hca`]);
//! - `ROCCL_IB_GID_INDEX`: force a GID index (`-1` or unset: automatic);
//! - `ROCCL_IB_ADDR_FAMILY`: `AF_INET`/`ipv4` (default) or `AF_INET6`/`ipv6` ([`parse_family`]);
//! - `ROCCL_IB_ADDR_RANGE`: only addresses in this prefix, e.g. `10.0.0.0/16` ([`parse_cidr`]).

use std::cmp::Ordering;
use std::fmt;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where Linux lists RDMA devices.
pub const SYSFS_ROOT: &str = "/sys/class/infiniband";
/// Environment variable restricting the devices/ports (see [`parse_hca`]).
pub const HCA_VAR: &str = "ROCCL_IB_HCA";
/// Environment variable forcing a GID index.
pub const GID_INDEX_VAR: &str = "ROCCL_IB_GID_INDEX";
/// Environment variable choosing the address family (see [`parse_family`]).
pub const FAMILY_VAR: &str = "ROCCL_IB_ADDR_FAMILY";
/// Environment variable restricting addresses to a prefix (see [`parse_cidr`]).
pub const RANGE_VAR: &str = "ROCCL_IB_ADDR_RANGE";

/// One readable, non-empty entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the GID table (what `ibv_modify_qp` and `ibv_query_gid` take).
    pub index: u32,
    /// The GID, in IPv6 form (IPv4 addresses appear IPv4-mapped, `::ffff:a.b.c.d`).
    pub gid: Ipv6Addr,
    /// Whether the entry's type is `RoCE v2` (otherwise `IB/RoCE v1`).
    pub roce_v2: bool,
    /// The netdev the address belongs to (`eth0`, `ens1f0np0`), when sysfs tells.
    pub ndev: Option<String>,
}

impl GidEntry {
    /// The address this GID stands for: IPv4 when the GID is IPv4-mapped, IPv6 otherwise.
    pub fn ip(&self) -> IpAddr {
        match self.gid.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(self.gid),
        }
    }

    /// Whether the GID is an IPv6 link-local address (`fe80::/10`).
    pub fn is_link_local(&self) -> bool {
        (self.gid.segments()[0] & 0xffc0) == 0xfe80
    }

    /// Whether the GID is all zeros (an unused slot).
    pub fn is_zero(&self) -> bool {
        self.gid.is_unspecified()
    }

    /// `RoCE v2` or `RoCE v1`.
    fn kind(&self) -> &'static str {
        if self.roce_v2 {
            "RoCE v2"
        } else {
            "RoCE v1"
        }
    }

    /// `"192.168.1.2 on eth0"` or `"192.168.1.2"`.
    fn addr_on(&self) -> String {
        match &self.ndev {
            Some(n) => format!("{} on {n}", self.ip()),
            None => self.ip().to_string(),
        }
    }
}

/// What sysfs says about one port of one RDMA device.
#[derive(Clone, Debug, PartialEq)]
pub struct PortInfo {
    /// Device name, e.g. `mlx5_0` or `irdma0`.
    pub dev: String,
    /// Port number (from 1).
    pub port: u32,
    /// The port state's name, e.g. `ACTIVE`, `DOWN`, `INIT`; `unknown` if unreadable.
    pub state: String,
    /// Whether the port is `ACTIVE`.
    pub active: bool,
    /// The link layer, e.g. `Ethernet` or `InfiniBand`; `unknown` if unreadable.
    pub link_layer: String,
    /// Whether the link layer is Ethernet (RoCE).
    pub ethernet: bool,
    /// Link rate in Gb/s, when readable.
    pub rate_gbps: Option<f64>,
    /// PCI address of the device (basename of the `device` symlink), e.g. `0000:17:00.0`.
    pub pci: Option<String>,
    /// The device's node GUID as sysfs prints it, e.g. `b8ce:f603:00a2:b4a0`.
    pub node_guid: Option<String>,
    /// MTU of the port's netdev, from `<dev>/device/net/<netdev>/mtu`, when readable.
    pub netdev_mtu: Option<u32>,
    /// The readable, non-zero GID entries, by increasing index (all-zero slots are unused
    /// and left out).
    pub gids: Vec<GidEntry>,
    /// GID indices whose address or type could not be read (e.g. `EINVAL` in containers).
    pub unreadable: Vec<u32>,
}

impl PortInfo {
    /// The entry at `index`, if it is readable and in use.
    pub fn gid(&self, index: u32) -> Option<&GidEntry> {
        self.gids.iter().find(|g| g.index == index)
    }

    /// The port's netdev, as named by its first GID entry that names one.
    pub fn netdev(&self) -> Option<&str> {
        self.gids.iter().find_map(|g| g.ndev.as_deref())
    }

    /// `"mlx5_0 port 1"`.
    fn name(&self) -> String {
        format!("{} port {}", self.dev, self.port)
    }
}

/// Compare names so that embedded numbers sort numerically: `mlx5_2` before `mlx5_10`.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].is_ascii_digit() && y[j].is_ascii_digit() {
            let (si, sj) = (i, j);
            while i < x.len() && x[i].is_ascii_digit() {
                i += 1;
            }
            while j < y.len() && y[j].is_ascii_digit() {
                j += 1;
            }
            let nx = trim_zeros(&x[si..i]);
            let ny = trim_zeros(&y[sj..j]);
            let ord = nx.len().cmp(&ny.len()).then_with(|| nx.cmp(ny));
            if ord != Ordering::Equal {
                return ord;
            }
        } else {
            if x[i] != y[j] {
                return x[i].cmp(&y[j]);
            }
            i += 1;
            j += 1;
        }
    }
    (x.len() - i).cmp(&(y.len() - j)).then_with(|| a.cmp(b))
}

/// The digits without leading zeros.
fn trim_zeros(d: &[u8]) -> &[u8] {
    let start = d.iter().position(|&c| c != b'0').unwrap_or(d.len());
    &d[start..]
}

/// Read a sysfs attribute, without its trailing newline.
fn read_trim(path: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(path)?.trim().to_string())
}

/// The entries of `dir` whose names are numbers, sorted; none if `dir` can't be listed.
fn numbered(dir: &Path) -> Vec<u32> {
    let mut out: Vec<u32> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect(),
        Err(_) => Vec::new(),
    };
    out.sort_unstable();
    out
}

/// Split a port state like `4: ACTIVE` into its name and whether it is active.
fn parse_state(s: &str) -> (String, bool) {
    let name = match s.split_once(':') {
        Some((_, name)) => name.trim(),
        None => s.trim(),
    };
    let name = if name.is_empty() { "unknown" } else { name };
    (name.to_string(), name.eq_ignore_ascii_case("ACTIVE"))
}

/// The rate in Gb/s from a sysfs rate like `100 Gb/sec (4X EDR)`.
fn parse_rate(s: &str) -> Option<f64> {
    let mut words = s.split_whitespace();
    let n: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?;
    (unit.starts_with("Gb/s") && n.is_finite() && n > 0.0).then_some(n)
}

/// The PCI address the `device` symlink of `dev_dir` points to.
fn pci_id(dev_dir: &Path) -> Option<String> {
    let link = dev_dir.join("device");
    if !fs::symlink_metadata(&link).ok()?.file_type().is_symlink() {
        return None;
    }
    let target = fs::canonicalize(&link)
        .or_else(|_| fs::read_link(&link))
        .ok()?;
    target.file_name()?.to_str().map(str::to_string)
}

/// Read one GID entry: `Ok(None)` for an unused (all-zero) slot, `Err` when the address
/// or the type can't be read or parsed.
fn read_gid(pdir: &Path, index: u32) -> io::Result<Option<GidEntry>> {
    let name = index.to_string();
    let text = read_trim(&pdir.join("gids").join(&name))?;
    let gid: Ipv6Addr = text
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not a GID"))?;
    if gid.is_unspecified() {
        // Unused slot: the kernel refuses to give its type, so don't ask.
        return Ok(None);
    }
    let ty = read_trim(&pdir.join("gid_attrs").join("types").join(&name))?;
    let ndev = read_trim(&pdir.join("gid_attrs").join("ndevs").join(&name))
        .ok()
        .filter(|n| !n.is_empty());
    Ok(Some(GidEntry {
        index,
        gid,
        roce_v2: ty.eq_ignore_ascii_case("RoCE v2"),
        ndev,
    }))
}

/// Read one port of a device.
fn scan_port(dev_dir: &Path, dev: &str, port: u32) -> PortInfo {
    let pdir = dev_dir.join("ports").join(port.to_string());
    let (state, active) = match read_trim(&pdir.join("state")) {
        Ok(s) => parse_state(&s),
        Err(_) => ("unknown".to_string(), false),
    };
    let link_layer = read_trim(&pdir.join("link_layer"))
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    let ethernet = link_layer.eq_ignore_ascii_case("Ethernet");
    let rate_gbps = read_trim(&pdir.join("rate"))
        .ok()
        .and_then(|s| parse_rate(&s));
    let mut gids = Vec::new();
    let mut unreadable = Vec::new();
    for index in numbered(&pdir.join("gids")) {
        match read_gid(&pdir, index) {
            Ok(Some(g)) => gids.push(g),
            Ok(None) => {}
            Err(_) => unreadable.push(index),
        }
    }
    let mut info = PortInfo {
        dev: dev.to_string(),
        port,
        state,
        active,
        link_layer,
        ethernet,
        rate_gbps,
        pci: pci_id(dev_dir),
        node_guid: read_trim(&dev_dir.join("node_guid"))
            .ok()
            .filter(|s| !s.is_empty()),
        netdev_mtu: None,
        gids,
        unreadable,
    };
    info.netdev_mtu = info.netdev().and_then(|n| {
        let path = dev_dir.join("device").join("net").join(n).join("mtu");
        read_trim(&path).ok()?.parse().ok()
    });
    info
}

/// Read every port of every RDMA device under `root` (normally [`SYSFS_ROOT`]), sorted by
/// device name (numbers compared numerically: `mlx5_2` before `mlx5_10`) then port.
///
/// A missing `root` means no RDMA device: `Ok` with nothing. Unreadable attributes are
/// tolerated: the state and link layer become `unknown`, GID entries whose address or type
/// can't be read (for any I/O error, e.g. `EINVAL` in containers) go to
/// [`PortInfo::unreadable`]. Only failing to list `root` itself is an error.
pub fn scan(root: &Path) -> Result<Vec<PortInfo>> {
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(Error::sys(
                format!("listing RDMA devices in {}", root.display()),
                e,
            ))
        }
    };
    let mut devs: Vec<String> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| root.join(n).join("ports").is_dir())
        .collect();
    devs.sort_by(|a, b| natural_cmp(a, b));
    let mut out = Vec::new();
    for dev in &devs {
        let dev_dir = root.join(dev);
        for port in numbered(&dev_dir.join("ports")) {
            out.push(scan_port(&dev_dir, dev, port));
        }
    }
    Ok(out)
}

/// One item of an HCA list: a device name, maybe with a port.
#[derive(Clone, Debug, PartialEq, Eq)]
struct HcaItem {
    dev: String,
    port: Option<u32>,
}

/// Which devices and ports may be used, parsed from `NCCL_IB_HCA`-style text by [`parse_hca`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaFilter {
    /// The text it was parsed from, for messages.
    spec: String,
    /// `^`: the list names ports to avoid.
    exclude: bool,
    /// `=`: names must match exactly (otherwise they are prefixes).
    exact: bool,
    /// The devices (and ports) listed.
    items: Vec<HcaItem>,
}

impl HcaFilter {
    /// Whether port `port` of device `dev` may be used.
    pub fn allows(&self, dev: &str, port: u32) -> bool {
        let listed = self.items.iter().any(|it| {
            let name_ok = if self.exact {
                dev == it.dev
            } else {
                dev.starts_with(&it.dev)
            };
            name_ok && it.port.map_or(true, |p| p == port)
        });
        listed != self.exclude
    }

    /// The text the filter was parsed from (trimmed).
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// Whether the list names ports to avoid (leading `^`).
    pub fn is_exclude(&self) -> bool {
        self.exclude
    }
}

impl fmt::Display for HcaFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec)
    }
}

/// Parse an HCA list in `NCCL_IB_HCA` syntax: comma-separated `dev` or `dev:port` items.
///
/// A leading `^` turns the list into ports to avoid; a leading `=` requires exact device names
/// (otherwise each name is a prefix: `mlx5_1` also matches `mlx5_10`); `^=` excludes exact
/// names. Both marks apply to the whole list. Examples: `mlx5_0:1,mlx5_1`, `^mlx5_2`,
/// `=irdma0`, `^=mlx5_1`.
///
/// Errors ([`Error::InvalidArgument`], naming `ROCCL_IB_HCA`): an empty list, a bad port
/// number, a name with characters other than letters, digits, `_`, `-`, `.` (notably `^` or
/// `=` anywhere but at the start).
pub fn parse_hca(spec: &str) -> Result<HcaFilter> {
    let spec = spec.trim();
    let bad = |why: String| Error::arg(format!("{HCA_VAR}={spec:?}: {why}"));
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let mut items = Vec::new();
    for raw in rest.split(',') {
        let item = raw.trim();
        if item.is_empty() {
            continue;
        }
        let (dev, port) = match item.split_once(':') {
            Some((d, p)) => {
                let p = p.trim();
                match p.parse::<u32>() {
                    Ok(n) if n >= 1 => (d.trim(), Some(n)),
                    _ => {
                        return Err(bad(format!(
                            "{p:?} in {item:?} is not a port number (ports count from 1)"
                        )))
                    }
                }
            }
            None => (item, None),
        };
        if dev.is_empty() {
            return Err(bad(format!("{item:?} has no device name")));
        }
        if let Some(c) = dev
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            let hint = if matches!(c, '^' | '=') {
                "; '^' and '=' may only start the whole list, e.g. ^=mlx5_0,mlx5_1"
            } else {
                ""
            };
            return Err(bad(format!(
                "{dev:?} is not a device name (unexpected {c:?}){hint}"
            )));
        }
        items.push(HcaItem {
            dev: dev.to_string(),
            port,
        });
    }
    if items.is_empty() {
        return Err(bad(
            "names no device; expected e.g. mlx5_0,mlx5_1:1 or ^mlx5_2 or =irdma0".to_string(),
        ));
    }
    Ok(HcaFilter {
        spec: spec.to_string(),
        exclude,
        exact,
        items,
    })
}

/// Address family of the GID to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Family {
    /// IPv4 (IPv4-mapped GIDs); the default.
    #[default]
    V4,
    /// IPv6 (GIDs that are not IPv4-mapped).
    V6,
}

impl Family {
    /// The family of `ip`.
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The value of `ROCCL_IB_ADDR_FAMILY` that selects the other family.
    fn other_var_value(self) -> &'static str {
        match self {
            Family::V4 => "AF_INET6",
            Family::V6 => "AF_INET",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

impl FromStr for Family {
    type Err = Error;

    fn from_str(s: &str) -> Result<Family> {
        parse_family(s)
    }
}

/// Parse an address family: `AF_INET`, `ipv4`, `inet`, `4` or `AF_INET6`, `ipv6`, `inet6`,
/// `6` (any case). Errors name `ROCCL_IB_ADDR_FAMILY` and list the valid values.
pub fn parse_family(s: &str) -> Result<Family> {
    match s.trim().to_ascii_lowercase().as_str() {
        "af_inet" | "ipv4" | "inet" | "v4" | "4" => Ok(Family::V4),
        "af_inet6" | "ipv6" | "inet6" | "v6" | "6" => Ok(Family::V6),
        _ => Err(Error::arg(format!(
            "{FAMILY_VAR}={s:?} is not an address family; valid values: AF_INET or ipv4, \
             AF_INET6 or ipv6"
        ))),
    }
}

/// An address prefix such as `10.0.0.0/16` or `fd00::/64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    /// The network address (host bits cleared).
    addr: IpAddr,
    /// Prefix length in bits.
    prefix: u8,
}

/// The `bits`-bit mask with the first `prefix` bits set, for a `u128`-held address.
fn mask(bits: u32, prefix: u8) -> u128 {
    let ones = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
    ones >> (128 - bits)
}

impl Cidr {
    /// The prefix `addr/prefix`, host bits cleared. Errors if `prefix` is longer than the
    /// address (32 or 128 bits).
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Cidr> {
        let bits = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if u32::from(prefix) > bits {
            return Err(Error::arg(format!(
                "{RANGE_VAR}: prefix length /{prefix} is longer than an {} address ({bits} bits)",
                Family::of(&addr)
            )));
        }
        let addr = match addr {
            IpAddr::V4(a) => {
                let m = mask(32, prefix) as u32;
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
            }
            IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask(128, prefix))),
        };
        Ok(Cidr { addr, prefix })
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length in bits.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The family of the prefix.
    pub fn family(&self) -> Family {
        Family::of(&self.addr)
    }

    /// Whether `ip` is in the prefix (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                let m = mask(32, self.prefix) as u32;
                u32::from(a) & m == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                u128::from(a) & mask(128, self.prefix) == u128::from(net)
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Cidr> {
        parse_cidr(s)
    }
}

/// Parse an address prefix like `10.0.0.0/16` or `fd00::/64` (host bits, as in
/// `10.0.0.7/16`, are cleared). The prefix length is required. Errors name
/// `ROCCL_IB_ADDR_RANGE`.
pub fn parse_cidr(s: &str) -> Result<Cidr> {
    let t = s.trim();
    let bad = |why: &str| {
        Error::arg(format!(
            "{RANGE_VAR}={s:?} {why}; expected an address prefix such as 10.0.0.0/16 or fd00::/64"
        ))
    };
    let (addr, len) = t
        .split_once('/')
        .ok_or_else(|| bad("has no prefix length"))?;
    let addr: IpAddr = addr
        .trim()
        .parse()
        .map_err(|_| bad("does not start with an IP address"))?;
    let prefix: u8 = len
        .trim()
        .parse()
        .map_err(|_| bad("has a bad prefix length"))?;
    Cidr::new(addr, prefix).map_err(|_| bad("has a prefix length longer than its address"))
}

/// What [`choose`] looks for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Criteria {
    /// Devices/ports that may be used (`ROCCL_IB_HCA`); `None`: all.
    pub hca: Option<HcaFilter>,
    /// Forced GID index (`ROCCL_IB_GID_INDEX`); `None`: automatic.
    pub gid_index: Option<u32>,
    /// Wanted address family (`ROCCL_IB_ADDR_FAMILY`); IPv4 by default.
    pub family: Family,
    /// Only addresses in this prefix (`ROCCL_IB_ADDR_RANGE`).
    pub range: Option<Cidr>,
}

impl Criteria {
    /// Read the criteria from `ROCCL_IB_HCA`, `ROCCL_IB_GID_INDEX`, `ROCCL_IB_ADDR_FAMILY` and
    /// `ROCCL_IB_ADDR_RANGE` (see [`Criteria::from_lookup`]).
    pub fn from_env() -> Result<Criteria> {
        Criteria::from_lookup(&|name| std::env::var(name).ok())
    }

    /// Same as [`Criteria::from_env`], reading variables through `get` (`None`: unset), so
    /// that any environment can be tested.
    ///
    /// Blank values count as unset; `ROCCL_IB_GID_INDEX=-1` means automatic. Without
    /// `ROCCL_IB_ADDR_FAMILY`, the family is that of `ROCCL_IB_ADDR_RANGE` if set, else IPv4.
    /// Errors ([`Error::InvalidArgument`]) name the variable at fault, including a range
    /// whose family contradicts `ROCCL_IB_ADDR_FAMILY`.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Criteria> {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let hca = var(HCA_VAR).map(|v| parse_hca(&v)).transpose()?;
        let gid_index = match var(GID_INDEX_VAR) {
            None => None,
            Some(v) if v == "-1" => None,
            Some(v) => Some(v.parse::<u32>().map_err(|_| {
                Error::arg(format!(
                    "{GID_INDEX_VAR}={v:?} is not a GID index; expected a number such as 3 \
                     (or -1 for automatic)"
                ))
            })?),
        };
        let family = var(FAMILY_VAR).map(|v| parse_family(&v)).transpose()?;
        let range = var(RANGE_VAR).map(|v| parse_cidr(&v)).transpose()?;
        let family = match (family, range) {
            (Some(f), Some(r)) if r.family() != f => {
                return Err(Error::arg(format!(
                    "{RANGE_VAR}={r} is an {} range but {FAMILY_VAR} asks for {f}; make them \
                     agree or unset {FAMILY_VAR}",
                    r.family()
                )))
            }
            (Some(f), _) => f,
            (None, Some(r)) => r.family(),
            (None, None) => Family::V4,
        };
        Ok(Criteria {
            hca,
            gid_index,
            family,
            range,
        })
    }
}

/// The device, port and GID [`choose`] picked, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Device name.
    pub dev: String,
    /// Port number.
    pub port: u32,
    /// GID index (same as `gid.index`).
    pub gid_index: u32,
    /// The chosen GID entry.
    pub gid: GidEntry,
    /// One sentence on why this entry, and why earlier ones were passed over.
    pub why: String,
}

/// Why a port gave no GID.
enum Reject {
    /// Not allowed by `ROCCL_IB_HCA`.
    Filtered,
    /// Link layer is not Ethernet.
    NotEthernet,
    /// Port is not ACTIVE.
    NotActive,
    /// No suitable GID entry; the text says why (after "mlx5_0 port 1 ").
    NoGid(String),
}

/// The text after "mlx5_0 port 1 " explaining a rejection.
fn reject_text(p: &PortInfo, r: &Reject, c: &Criteria) -> String {
    match r {
        Reject::Filtered => {
            let hca = c.hca.as_ref().map_or("", |h| h.spec());
            let verb = if c.hca.as_ref().is_some_and(|h| h.is_exclude()) {
                "is excluded by"
            } else {
                "is not selected by"
            };
            format!("{verb} {HCA_VAR}={hca}")
        }
        Reject::NotEthernet => format!("is {}, not Ethernet", p.link_layer),
        Reject::NotActive if p.state.eq_ignore_ascii_case("DOWN") => "is DOWN".to_string(),
        Reject::NotActive => format!("is {}, not ACTIVE", p.state),
        Reject::NoGid(s) => s.clone(),
    }
}

/// Why an entry does not suit an automatic choice, or `None` if it does.
fn unsuitable(g: &GidEntry, c: &Criteria) -> Option<String> {
    let mut why = Vec::new();
    if !g.roce_v2 {
        why.push("RoCE v1".to_string());
    }
    let ip = g.ip();
    if g.is_zero() {
        why.push("empty".to_string());
    } else if g.is_link_local() {
        why.push("link-local".to_string());
    } else if Family::of(&ip) != c.family {
        why.push(Family::of(&ip).to_string());
    } else if let Some(r) = c.range.filter(|r| !r.contains(ip)) {
        why.push(format!("outside {r}"));
    }
    (!why.is_empty()).then(|| why.join(" "))
}

/// "0-3, 5, 7-8".
fn index_ranges(idx: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            idx[i].to_string()
        } else {
            format!("{}-{}", idx[i], idx[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// "GIDs 0-1 are link-local, 2 is RoCE v1" from (index, reason) pairs sorted by index.
fn skipped_text(skipped: &[(u32, String)]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < skipped.len() {
        let mut j = i;
        while j + 1 < skipped.len()
            && skipped[j + 1].0 == skipped[j].0 + 1
            && skipped[j + 1].1 == skipped[i].1
        {
            j += 1;
        }
        let first = parts.is_empty();
        let reason = &skipped[i].1;
        parts.push(match (i == j, first) {
            (true, true) => format!("GID {} is {reason}", skipped[i].0),
            (true, false) => format!("{} is {reason}", skipped[i].0),
            (false, true) => format!("GIDs {}-{} are {reason}", skipped[i].0, skipped[j].0),
            (false, false) => format!("{}-{} are {reason}", skipped[i].0, skipped[j].0),
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// The port's entries and unreadable indices, by index (`None`: unreadable).
fn slots(p: &PortInfo) -> Vec<(u32, Option<&GidEntry>)> {
    let mut v: Vec<(u32, Option<&GidEntry>)> = p.gids.iter().map(|g| (g.index, Some(g))).collect();
    v.extend(p.unreadable.iter().map(|&i| (i, None)));
    v.sort_by_key(|s| s.0);
    v
}

/// A row of a GID listing: an entry, or a run of consecutive unreadable indices.
enum Row<'a> {
    /// A readable entry.
    Entry(&'a GidEntry),
    /// Unreadable indices `first..=last`.
    Unreadable(u32, u32),
}

/// The port's entries by index, runs of unreadable indices merged (a kernel may refuse
/// hundreds of them).
fn rows(p: &PortInfo) -> Vec<Row<'_>> {
    let mut out: Vec<Row<'_>> = Vec::new();
    for (i, s) in slots(p) {
        match (s, out.last_mut()) {
            (Some(g), _) => out.push(Row::Entry(g)),
            (None, Some(Row::Unreadable(_, last))) if *last + 1 == i => *last = i,
            (None, _) => out.push(Row::Unreadable(i, i)),
        }
    }
    out
}

/// "3" or "3-7".
fn span(first: u32, last: u32) -> String {
    if first == last {
        first.to_string()
    } else {
        format!("{first}-{last}")
    }
}

/// "0 fe80::1 RoCE v2 link-local" for error messages.
fn entry_text(g: &GidEntry) -> String {
    let ll = if g.is_link_local() { " link-local" } else { "" };
    format!("{} {} {}{ll}", g.index, g.ip(), g.kind())
}

/// GID entries passed over, as (index, reason) pairs by increasing index.
type Skipped = Vec<(u32, String)>;

/// The first suitable entry of `p` for an automatic choice, with the entries skipped before
/// it; or the rejection.
fn pick_auto<'a>(
    p: &'a PortInfo,
    c: &Criteria,
) -> std::result::Result<(&'a GidEntry, Skipped), Reject> {
    let mut skipped = Vec::new();
    for (index, slot) in slots(p) {
        match slot {
            None => skipped.push((index, "unreadable".to_string())),
            Some(g) => match unsuitable(g, c) {
                None => return Ok((g, skipped)),
                Some(why) => skipped.push((index, why)),
            },
        }
    }
    let range = c.range.map(|r| format!(" in {r}")).unwrap_or_default();
    let entries: Vec<String> = rows(p)
        .into_iter()
        .map(|r| match r {
            Row::Entry(g) => entry_text(g),
            Row::Unreadable(a, b) => format!("{} unreadable", span(a, b)),
        })
        .collect();
    let entries = if entries.is_empty() {
        "no GID entries".to_string()
    } else {
        format!("entries: {}", entries.join(", "))
    };
    Err(Reject::NoGid(format!(
        "has no RoCE v2 {} GID{range} ({entries})",
        c.family
    )))
}

/// The entry at the forced `index` of `p`, or the rejection.
fn pick_forced(p: &PortInfo, index: u32) -> std::result::Result<&GidEntry, Reject> {
    if let Some(g) = p.gid(index).filter(|g| !g.is_zero()) {
        return Ok(g);
    }
    if p.unreadable.contains(&index) {
        return Err(Reject::NoGid(format!(
            "cannot read GID {index} (sysfs refused it, as happens in containers)"
        )));
    }
    let mut have: Vec<u32> = p
        .gids
        .iter()
        .filter(|g| !g.is_zero())
        .map(|g| g.index)
        .collect();
    have.sort_unstable();
    let mut bad = p.unreadable.clone();
    bad.sort_unstable();
    let mut known = Vec::new();
    if !have.is_empty() {
        known.push(format!("readable indices: {}", index_ranges(&have)));
    }
    if !bad.is_empty() {
        known.push(format!("unreadable: {}", index_ranges(&bad)));
    }
    let known = if known.is_empty() {
        "its table is empty".to_string()
    } else {
        known.join("; ")
    };
    Err(Reject::NoGid(format!(
        "has no GID at index {index} ({known})"
    )))
}

/// Pick the device, port and GID to use.
///
/// Only ACTIVE ports with an Ethernet link layer that the HCA filter allows are considered,
/// in device order (numbers compared numerically), then port order.
///
/// - With a forced `gid_index`, the first such port that has a readable entry at that index
///   gives it, whatever its type and address (the family and range are not applied; the
///   explanation warns about RoCE v1 or link-local entries).
/// - Otherwise the lowest-index entry that is RoCE v2, not all zeros, not link-local
///   (`fe80::/10`), of the wanted family (IPv4-mapped GIDs count as IPv4) and inside the range.
///
/// [`Choice::why`] explains in one sentence, e.g. `mlx5_0 port 1 GID 3: RoCE v2, IPv4
/// 192.168.1.2 on ens1f0np0 (GID 0 is RoCE v1 link-local, 1 is link-local, 2 is RoCE v1)`.
///
/// When nothing fits, the [`Error::InvalidArgument`] says why for every port (excluded by
/// the filter, not Ethernet, not ACTIVE, the GID entries it has) and how to fix it. A range
/// of the other family than `c.family` is an error too.
pub fn choose(ports: &[PortInfo], c: &Criteria) -> Result<Choice> {
    if let Some(r) = c.range.filter(|r| r.family() != c.family) {
        return Err(Error::arg(format!(
            "{RANGE_VAR}={r} is an {} range but the wanted family is {}",
            r.family(),
            c.family
        )));
    }
    let mut order: Vec<&PortInfo> = ports.iter().collect();
    order.sort_by(|a, b| natural_cmp(&a.dev, &b.dev).then(a.port.cmp(&b.port)));
    let mut rejected: Vec<(&PortInfo, Reject)> = Vec::new();
    for p in order {
        let reject = if !c.hca.as_ref().map_or(true, |h| h.allows(&p.dev, p.port)) {
            Some(Reject::Filtered)
        } else if !p.ethernet {
            Some(Reject::NotEthernet)
        } else if !p.active {
            Some(Reject::NotActive)
        } else {
            None
        };
        if let Some(r) = reject {
            rejected.push((p, r));
            continue;
        }
        let (g, detail) = match c.gid_index {
            Some(index) => match pick_forced(p, index) {
                Ok(g) => {
                    let mut warn = Vec::new();
                    if !g.roce_v2 {
                        warn.push("not RoCE v2");
                    }
                    if g.is_link_local() {
                        warn.push("link-local, reachable only on the same L2 segment");
                    }
                    let warn = if warn.is_empty() {
                        String::new()
                    } else {
                        format!(" (warning: {})", warn.join("; "))
                    };
                    (
                        g,
                        format!("forced by {GID_INDEX_VAR}, {}", kind_family(g)) + &warn,
                    )
                }
                Err(r) => {
                    rejected.push((p, r));
                    continue;
                }
            },
            None => match pick_auto(p, c) {
                Ok((g, skipped)) => {
                    let skipped = if skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", skipped_text(&skipped))
                    };
                    (g, kind_family(g) + &skipped)
                }
                Err(r) => {
                    rejected.push((p, r));
                    continue;
                }
            },
        };
        let earlier = if rejected.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = rejected
                .iter()
                .map(|(q, r)| format!("{} {}", q.name(), reject_text(q, r, c)))
                .collect();
            format!("; passed over: {}", list.join("; "))
        };
        return Ok(Choice {
            dev: p.dev.clone(),
            port: p.port,
            gid_index: g.index,
            gid: g.clone(),
            why: format!("{} GID {}: {detail}{earlier}", p.name(), g.index),
        });
    }
    Err(no_choice(ports, &rejected, c))
}

/// "RoCE v2, IPv4 192.168.1.2 on eth0".
fn kind_family(g: &GidEntry) -> String {
    format!("{}, {} {}", g.kind(), Family::of(&g.ip()), g.addr_on())
}

/// The error [`choose`] returns when no port gives a GID.
fn no_choice(ports: &[PortInfo], rejected: &[(&PortInfo, Reject)], c: &Criteria) -> Error {
    let head = match c.gid_index {
        Some(i) => format!("no usable GID at {GID_INDEX_VAR}={i}"),
        None => "no usable RoCE v2 GID".to_string(),
    };
    if ports.is_empty() {
        return Error::arg(format!(
            "{head}: no RDMA device found in {SYSFS_ROOT}. Fix: load the NIC's RDMA driver \
             (irdma for Intel E810, mlx5_ib for NVIDIA ConnectX) and check `rdma link`; in a \
             container, expose {SYSFS_ROOT} and /dev/infiniband."
        ));
    }
    let reasons: Vec<String> = rejected
        .iter()
        .map(|(p, r)| format!("{} {}", p.name(), reject_text(p, r, c)))
        .collect();
    let mut fixes: Vec<String> = Vec::new();
    let mut add = |s: String| {
        if !fixes.contains(&s) {
            fixes.push(s);
        }
    };
    for (_, r) in rejected {
        match r {
            Reject::Filtered => {
                let seen: Vec<String> = ports
                    .iter()
                    .map(|p| format!("{}:{}", p.dev, p.port))
                    .collect();
                add(format!(
                    "change or unset {HCA_VAR} (ports found: {})",
                    seen.join(", ")
                ));
            }
            Reject::NotEthernet => add(
                "use a RoCE port (Ethernet link layer): roccl does not drive InfiniBand links"
                    .to_string(),
            ),
            Reject::NotActive => {
                add("bring the port up (cable, switch port, `ip link set <netdev> up`)".into())
            }
            Reject::NoGid(_) if c.gid_index.is_some() => add(format!(
                "set {GID_INDEX_VAR} to a readable index, or unset it"
            )),
            Reject::NoGid(_) => {
                let widen = if c.range.is_some() {
                    format!("widen or unset {RANGE_VAR}, ")
                } else {
                    String::new()
                };
                add(format!(
                    "{widen}assign {} address to its netdev, or set {GID_INDEX_VAR} / \
                     {FAMILY_VAR}={}",
                    match c.family {
                        Family::V4 => "an IPv4",
                        Family::V6 => "a global IPv6",
                    },
                    c.family.other_var_value()
                ));
            }
        }
    }
    Error::arg(format!(
        "{head}: {}. Fix: {}.",
        reasons.join("; "),
        fixes.join("; ")
    ))
}

/// A table of every port and its GID entries, the chosen entry marked with `=>` and
/// `<- chosen`, followed by the choice's explanation; for `roccl-info` and debug logs.
pub fn describe(ports: &[PortInfo], choice: Option<&Choice>) -> String {
    if ports.is_empty() {
        return format!("no RDMA device found in {SYSFS_ROOT}\n");
    }
    let mut out = String::new();
    for p in ports {
        let mut facts = vec![p.state.clone(), p.link_layer.clone()];
        if let Some(r) = p.rate_gbps {
            facts.push(format!("{r} Gb/s"));
        }
        if let Some(pci) = &p.pci {
            facts.push(format!("pci {pci}"));
        }
        if let Some(n) = p.netdev() {
            match p.netdev_mtu {
                Some(m) => facts.push(format!("netdev {n} mtu {m}")),
                None => facts.push(format!("netdev {n}")),
            }
        }
        if let Some(g) = &p.node_guid {
            facts.push(format!("guid {g}"));
        }
        out.push_str(&format!("{}: {}\n", p.name(), facts.join(", ")));
        let listing = rows(p);
        let cells: Vec<[String; 4]> = listing
            .iter()
            .map(|r| match r {
                Row::Entry(g) => [
                    g.index.to_string(),
                    if p.ethernet { g.kind() } else { "IB" }.to_string(),
                    g.ip().to_string(),
                    g.ndev.clone().unwrap_or_else(|| "-".to_string()),
                ],
                Row::Unreadable(a, b) => [
                    span(*a, *b),
                    "unreadable".to_string(),
                    "-".into(),
                    "-".into(),
                ],
            })
            .collect();
        if cells.is_empty() {
            out.push_str("      (no GID entries)\n");
            continue;
        }
        let header = [
            "idx".to_string(),
            "type".to_string(),
            "address".to_string(),
            "netdev".to_string(),
        ];
        let mut w = [0usize; 4];
        for r in cells.iter().chain(std::iter::once(&header)) {
            for (k, cell) in r.iter().enumerate() {
                w[k] = w[k].max(cell.len());
            }
        }
        let line = |mark: &str, r: &[String; 4], tail: &str| {
            let text = format!(
                "   {mark:<2} {:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}{tail}",
                r[0],
                r[1],
                r[2],
                r[3],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2],
                w3 = w[3]
            );
            format!("{}\n", text.trim_end())
        };
        out.push_str(&line("", &header, ""));
        for (r, row) in cells.iter().zip(&listing) {
            let chosen = match row {
                Row::Entry(g) => choice.is_some_and(|ch| {
                    ch.dev == p.dev && ch.port == p.port && ch.gid_index == g.index
                }),
                Row::Unreadable(..) => false,
            };
            if chosen {
                out.push_str(&line("=>", r, "  <- chosen"));
            } else {
                out.push_str(&line("", r, ""));
            }
        }
    }
    match choice {
        Some(ch) => out.push_str(&format!("chosen: {}\n", ch.why)),
        None => out.push_str("chosen: none\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fake sysfs tree from `tests/data/sysfs/`.
    fn tree(case: &str) -> Vec<PortInfo> {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/sysfs")).join(case);
        assert!(root.is_dir(), "missing test tree {}", root.display());
        scan(&root).unwrap()
    }

    /// Criteria from a fake environment.
    fn env(vars: &[(&str, &str)]) -> Result<Criteria> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Criteria::from_lookup(&|name| map.get(name).cloned())
    }

    fn pick(case: &str, vars: &[(&str, &str)]) -> Result<Choice> {
        choose(&tree(case), &env(vars).unwrap())
    }

    fn err_text(r: Result<Choice>) -> String {
        match r {
            Ok(c) => panic!("expected an error, chose {c:?}"),
            Err(e) => {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                e.to_string()
            }
        }
    }

    #[test]
    fn e810_scan() {
        let ports = tree("e810");
        assert_eq!(ports.len(), 1);
        let p = &ports[0];
        assert_eq!((p.dev.as_str(), p.port), ("irdma0", 1));
        assert!(p.active && p.ethernet);
        assert_eq!(p.state, "ACTIVE");
        assert_eq!(p.rate_gbps, Some(100.0));
        // The `device` symlink dangles in the test tree: its own basename is used.
        assert_eq!(p.pci.as_deref(), Some("0000:01:00.0"));
        assert_eq!(p.node_guid.as_deref(), Some("6efe:54ff:fe3d:8a10"));
        assert_eq!(p.netdev(), Some("enp1s0f0"));
        assert_eq!(p.netdev_mtu, None);
        // Index 2 is all zeros: an unused slot, left out and not unreadable.
        let idx: Vec<u32> = p.gids.iter().map(|g| g.index).collect();
        assert_eq!(idx, [0, 1]);
        assert!(p.unreadable.is_empty());
        assert!(p.gids[0].is_link_local() && p.gids[0].roce_v2);
        assert_eq!(p.gids[1].ip(), "10.1.0.11".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn e810_choice() {
        let c = pick("e810", &[]).unwrap();
        assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("irdma0", 1, 1));
        assert_eq!(c.gid.index, 1);
        assert_eq!(
            c.why,
            "irdma0 port 1 GID 1: RoCE v2, IPv4 10.1.0.11 on enp1s0f0 (GID 0 is link-local)"
        );
        // No IPv6 global address on this NIC.
        let e = err_text(pick("e810", &[(FAMILY_VAR, "ipv6")]));
        assert!(e.contains("irdma0 port 1 has no RoCE v2 IPv6 GID (entries: 0 fe80::6efe:54ff:fe3d:8a10 RoCE v2 link-local, 1 10.1.0.11 RoCE v2)"), "{e}");
        assert!(e.contains("ROCCL_IB_ADDR_FAMILY=AF_INET"), "{e}");
    }

    #[test]
    fn mlx5_scan() {
        let ports = tree("mlx5");
        assert_eq!(ports.len(), 1);
        let p = &ports[0];
        // The `device` symlink resolves inside the test tree, which also holds the netdev MTU.
        assert_eq!(p.pci.as_deref(), Some("0000:17:00.0"));
        assert_eq!(p.netdev_mtu, Some(9000));
        let kinds: Vec<(u32, bool)> = p.gids.iter().map(|g| (g.index, g.roce_v2)).collect();
        assert_eq!(
            kinds,
            [
                (0, false),
                (1, true),
                (2, false),
                (3, true),
                (4, false),
                (5, true)
            ]
        );
        assert!(p.unreadable.is_empty());
    }

    #[test]
    fn mlx5_ipv4_and_ipv6() {
        let c = pick("mlx5", &[]).unwrap();
        assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("mlx5_0", 1, 3));
        assert_eq!(c.gid.ip(), "192.168.1.2".parse::<IpAddr>().unwrap());
        assert_eq!(
            c.why,
            "mlx5_0 port 1 GID 3: RoCE v2, IPv4 192.168.1.2 on ens1f0np0 \
             (GID 0 is RoCE v1 link-local, 1 is link-local, 2 is RoCE v1)"
        );
        for v in ["AF_INET6", "ipv6", "af_inet6"] {
            let c = pick("mlx5", &[(FAMILY_VAR, v)]).unwrap();
            assert_eq!(c.gid_index, 5, "{v}");
            assert_eq!(c.gid.ip(), "fd00::2".parse::<IpAddr>().unwrap());
            assert!(c.why.contains("IPv6 fd00::2"), "{}", c.why);
            assert!(
                c.why
                    .contains("2 is RoCE v1 IPv4, 3 is IPv4, 4 is RoCE v1)"),
                "{}",
                c.why
            );
        }
        // A range that matches nothing.
        let e = err_text(pick("mlx5", &[(RANGE_VAR, "10.0.0.0/8")]));
        assert!(e.contains("no RoCE v2 IPv4 GID in 10.0.0.0/8"), "{e}");
        assert!(e.contains("widen or unset ROCCL_IB_ADDR_RANGE"), "{e}");
    }

    #[test]
    fn container_unreadable_entries() {
        // gids/2, gid_attrs/types/3 and gid_attrs/ndevs/4 are directories in the test tree:
        // reading them fails with EISDIR, standing in for the EINVAL that containers give.
        let ports = tree("container");
        let p = &ports[0];
        assert_eq!(p.unreadable, [2, 3]);
        let idx: Vec<u32> = p.gids.iter().map(|g| g.index).collect();
        assert_eq!(idx, [0, 1, 4, 5, 6, 7]);
        // An unreadable netdev only loses the name.
        assert_eq!(p.gid(4).unwrap().ndev, None);
        assert_eq!(p.gid(5).unwrap().ndev.as_deref(), Some("eth0"));
        let c = choose(&ports, &Criteria::default()).unwrap();
        assert_eq!(c.gid_index, 7);
        assert_eq!(c.gid.ip(), "192.168.1.3".parse::<IpAddr>().unwrap());
        assert!(c.why.contains("2-3 are unreadable"), "{}", c.why);
        assert!(c.why.contains("4 is RoCE v1 IPv6, 5 is IPv6"), "{}", c.why);
        let table = describe(&ports, Some(&c));
        assert!(table.contains("unreadable"), "{table}");
    }

    #[test]
    fn two_nics() {
        let c = pick("two_nics", &[]).unwrap();
        assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_0", 3));
        assert_eq!(c.gid.ip(), "10.0.0.5".parse::<IpAddr>().unwrap());

        let c = pick("two_nics", &[(RANGE_VAR, "10.1.0.0/16")]).unwrap();
        assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_1", 3));
        assert!(
            c.why
                .contains("passed over: mlx5_0 port 1 has no RoCE v2 IPv4 GID in 10.1.0.0/16"),
            "{}",
            c.why
        );

        let c = pick("two_nics", &[(HCA_VAR, "^mlx5_0")]).unwrap();
        assert_eq!((c.dev.as_str(), c.port), ("mlx5_1", 1));
        assert!(
            c.why
                .contains("passed over: mlx5_0 port 1 is excluded by ROCCL_IB_HCA=^mlx5_0"),
            "{}",
            c.why
        );

        let c = pick("two_nics", &[(HCA_VAR, "=mlx5_1:1")]).unwrap();
        assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("mlx5_1", 1, 3));

        let e = err_text(pick("two_nics", &[(HCA_VAR, "mlx5_1:2")]));
        assert!(
            e.starts_with("invalid argument: no usable RoCE v2 GID: "),
            "{e}"
        );
        assert!(
            e.contains("mlx5_0 port 1 is not selected by ROCCL_IB_HCA=mlx5_1:2"),
            "{e}"
        );
        assert!(
            e.contains("mlx5_1 port 1 is not selected by ROCCL_IB_HCA=mlx5_1:2"),
            "{e}"
        );
        assert!(e.contains("ports found: mlx5_0:1, mlx5_1:1"), "{e}");
    }

    #[test]
    fn range_skips_addresses_outside() {
        // A hand-built port with two IPv4 addresses on one netdev.
        let entry = |index: u32, ip: &str| GidEntry {
            index,
            gid: format!("::ffff:{ip}").parse().unwrap(),
            roce_v2: true,
            ndev: Some("eth1".to_string()),
        };
        let port = PortInfo {
            dev: "irdma1".to_string(),
            port: 1,
            state: "ACTIVE".to_string(),
            active: true,
            link_layer: "Ethernet".to_string(),
            ethernet: true,
            rate_gbps: None,
            pci: None,
            node_guid: None,
            netdev_mtu: None,
            gids: vec![entry(0, "172.16.0.4"), entry(1, "10.2.0.4")],
            unreadable: vec![],
        };
        let ports = [port];
        assert_eq!(choose(&ports, &Criteria::default()).unwrap().gid_index, 0);
        let c = choose(&ports, &env(&[(RANGE_VAR, "10.2.0.0/16")]).unwrap()).unwrap();
        assert_eq!(c.gid_index, 1);
        assert_eq!(
            c.why,
            "irdma1 port 1 GID 1: RoCE v2, IPv4 10.2.0.4 on eth1 (GID 0 is outside 10.2.0.0/16)"
        );
    }

    #[test]
    fn unreadable_runs_are_merged() {
        // A kernel may refuse every unused slot of a 256-entry table: keep messages short.
        let mut ports = tree("e810");
        ports[0].unreadable = (2..=255).collect();
        let e = err_text(choose(&ports, &env(&[(FAMILY_VAR, "ipv6")]).unwrap()));
        assert!(e.contains("1 10.1.0.11 RoCE v2, 2-255 unreadable)"), "{e}");
        let table = describe(&ports, None);
        assert_eq!(table.matches("unreadable").count(), 1, "{table}");
        assert!(table.contains("2-255"), "{table}");
        let e = err_text(choose(&ports, &env(&[(GID_INDEX_VAR, "300")]).unwrap()));
        assert!(
            e.contains("(readable indices: 0-1; unreadable: 2-255)"),
            "{e}"
        );
    }

    #[test]
    fn device_order_is_numeric() {
        assert_eq!(natural_cmp("mlx5_2", "mlx5_10"), Ordering::Less);
        assert_eq!(natural_cmp("mlx5_10", "mlx5_9"), Ordering::Greater);
        assert_eq!(natural_cmp("irdma0", "mlx5_0"), Ordering::Less);
        assert_eq!(natural_cmp("mlx5_0", "mlx5_0"), Ordering::Equal);
        assert_eq!(natural_cmp("mlx5", "mlx5_0"), Ordering::Less);
        assert_ne!(natural_cmp("a01", "a1"), Ordering::Equal);
        // choose() follows that order whatever order it is given.
        let mut ports = tree("two_nics");
        ports.reverse();
        assert_eq!(choose(&ports, &Criteria::default()).unwrap().dev, "mlx5_0");
    }

    #[test]
    fn infiniband_and_down() {
        let ports = tree("infiniband");
        assert!(!ports[0].ethernet && ports[0].active);
        assert!(ports[1].ethernet && !ports[1].active);
        assert_eq!(ports[1].state, "DOWN");
        let e = err_text(choose(&ports, &Criteria::default()));
        assert!(
            e.contains("mlx5_0 port 1 is InfiniBand, not Ethernet"),
            "{e}"
        );
        assert!(e.contains("mlx5_1 port 1 is DOWN"), "{e}");
        assert!(e.contains("Fix: "), "{e}");
        assert!(e.contains("bring the port up"), "{e}");
        assert!(e.contains("InfiniBand links"), "{e}");
        assert!(e.ends_with('.'), "{e}");
        let table = describe(&ports, None);
        assert!(
            table.contains("mlx5_0 port 1: ACTIVE, InfiniBand"),
            "{table}"
        );
        assert!(table.contains(" IB "), "{table}");
    }

    #[test]
    fn no_ports() {
        let e = err_text(choose(&[], &Criteria::default()));
        assert!(e.contains("no RDMA device found"), "{e}");
        assert!(describe(&[], None).contains("no RDMA device found"));
    }

    #[test]
    fn forced_gid_index() {
        // Exists: taken even though it is RoCE v1, with a warning.
        let c = pick("mlx5", &[(GID_INDEX_VAR, "2")]).unwrap();
        assert_eq!(c.gid_index, 2);
        assert!(
            c.why.contains("forced by ROCCL_IB_GID_INDEX, RoCE v1"),
            "{}",
            c.why
        );
        assert!(c.why.contains("warning: not RoCE v2"), "{}", c.why);
        // The family is not applied to a forced index.
        let c = pick("mlx5", &[(GID_INDEX_VAR, "5")]).unwrap();
        assert_eq!(c.gid.ip(), "fd00::2".parse::<IpAddr>().unwrap());
        // -1 means automatic.
        assert_eq!(pick("mlx5", &[(GID_INDEX_VAR, "-1")]).unwrap().gid_index, 3);
        // Missing (9) and unused (6, all zeros).
        for i in ["9", "6"] {
            let e = err_text(pick("mlx5", &[(GID_INDEX_VAR, i)]));
            assert!(
                e.contains(&format!("no usable GID at ROCCL_IB_GID_INDEX={i}")),
                "{e}"
            );
            assert!(
                e.contains(&format!(
                    "mlx5_0 port 1 has no GID at index {i} (readable indices: 0-5)"
                )),
                "{e}"
            );
        }
        // Unreadable.
        let e = err_text(pick("container", &[(GID_INDEX_VAR, "2")]));
        assert!(e.contains("mlx5_0 port 1 cannot read GID 2"), "{e}");
        assert!(
            e.contains("set ROCCL_IB_GID_INDEX to a readable index"),
            "{e}"
        );
        // Forced on two NICs: the first allowed port wins.
        let c = pick("two_nics", &[(GID_INDEX_VAR, "3"), (HCA_VAR, "mlx5_1")]).unwrap();
        assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_1", 3));
    }

    #[test]
    fn hca_parsing() {
        let f = parse_hca("mlx5_1").unwrap();
        assert!(f.allows("mlx5_1", 1) && f.allows("mlx5_10", 2));
        assert!(!f.allows("mlx5_0", 1));
        let f = parse_hca("=mlx5_1").unwrap();
        assert!(f.allows("mlx5_1", 1) && !f.allows("mlx5_10", 1));
        let f = parse_hca("^mlx5_0").unwrap();
        assert!(f.is_exclude());
        assert!(!f.allows("mlx5_0", 1) && !f.allows("mlx5_01", 1) && f.allows("mlx5_1", 1));
        let f = parse_hca("^=mlx5_0").unwrap();
        assert!(!f.allows("mlx5_0", 1) && f.allows("mlx5_01", 1));
        let f = parse_hca(" mlx5_0:1 , irdma ,").unwrap();
        assert_eq!(f.spec(), "mlx5_0:1 , irdma ,");
        assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
        assert!(f.allows("irdma0", 1) && f.allows("irdma1", 2));
        let f = parse_hca("^mlx5_0:2").unwrap();
        assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
        assert_eq!(f.to_string(), "^mlx5_0:2");

        for (bad, what) in [
            ("", "names no device"),
            ("^", "names no device"),
            ("^=", "names no device"),
            (",", "names no device"),
            ("mlx5_0:x", "is not a port number"),
            ("mlx5_0:0", "is not a port number"),
            ("mlx5_0:", "is not a port number"),
            (":1", "has no device name"),
            ("=^mlx5_0", "'^' and '=' may only start"),
            ("mlx5_0,^mlx5_1", "'^' and '=' may only start"),
            ("mlx5 0", "is not a device name"),
        ] {
            let e = parse_hca(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)));
            let e = e.to_string();
            assert!(e.contains("ROCCL_IB_HCA="), "{bad:?}: {e}");
            assert!(e.contains(what), "{bad:?}: {e}");
        }
    }

    #[test]
    fn cidr_parsing() {
        let c = parse_cidr("10.0.0.0/16").unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/16");
        assert_eq!(c.family(), Family::V4);
        assert!(c.contains("10.0.255.1".parse().unwrap()));
        assert!(!c.contains("10.1.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.0.0.9".parse().unwrap()));
        assert!(!c.contains("fd00::1".parse().unwrap()));
        let c = parse_cidr(" 10.1.2.3/16 ").unwrap();
        assert_eq!(c.addr(), "10.1.0.0".parse::<IpAddr>().unwrap());
        assert_eq!(c.prefix(), 16);
        let c: Cidr = "fd00::/64".parse().unwrap();
        assert_eq!(c.family(), Family::V6);
        assert!(c.contains("fd00::2".parse().unwrap()));
        assert!(!c.contains("fd00:0:0:1::2".parse().unwrap()));
        assert!(!c.contains("10.0.0.1".parse().unwrap()));
        let all = parse_cidr("0.0.0.0/0").unwrap();
        assert!(all.contains("255.255.255.255".parse().unwrap()));
        let host = parse_cidr("10.0.0.5/32").unwrap();
        assert!(host.contains("10.0.0.5".parse().unwrap()));
        assert!(!host.contains("10.0.0.4".parse().unwrap()));
        assert!(parse_cidr("::/0")
            .unwrap()
            .contains("fd00::1".parse().unwrap()));
        assert!(parse_cidr("fd00::1/128")
            .unwrap()
            .contains("fd00::1".parse().unwrap()));

        for (bad, what) in [
            ("10.0.0.0", "has no prefix length"),
            ("10.0.0/8", "does not start with an IP address"),
            ("eth0/8", "does not start with an IP address"),
            ("10.0.0.0/x", "bad prefix length"),
            ("10.0.0.0/33", "longer than its address"),
            ("fd00::/129", "longer than its address"),
            ("", "has no prefix length"),
        ] {
            let e = parse_cidr(bad).unwrap_err().to_string();
            assert!(e.contains("ROCCL_IB_ADDR_RANGE="), "{bad:?}: {e}");
            assert!(e.contains(what), "{bad:?}: {e}");
        }
    }

    #[test]
    fn family_parsing() {
        for v in ["AF_INET", "af_inet", "ipv4", "IPv4", " inet ", "4"] {
            assert_eq!(parse_family(v).unwrap(), Family::V4, "{v}");
        }
        for v in ["AF_INET6", "ipv6", "IPV6", "inet6", "6"] {
            assert_eq!(v.parse::<Family>().unwrap(), Family::V6, "{v}");
        }
        for v in ["", "AF_UNIX", "ipv5", "any"] {
            let e = parse_family(v).unwrap_err().to_string();
            assert!(e.contains("ROCCL_IB_ADDR_FAMILY="), "{e}");
            assert!(e.contains("AF_INET6"), "{e}");
        }
        assert_eq!(Family::default(), Family::V4);
    }

    #[test]
    fn criteria_from_env() {
        assert_eq!(env(&[]).unwrap(), Criteria::default());
        // Blank values count as unset.
        assert_eq!(
            env(&[(HCA_VAR, " "), (GID_INDEX_VAR, "")]).unwrap(),
            Criteria::default()
        );
        let c = env(&[
            (HCA_VAR, "=mlx5_1:1"),
            (GID_INDEX_VAR, " 3 "),
            (FAMILY_VAR, "AF_INET"),
            (RANGE_VAR, "10.1.0.0/16"),
        ])
        .unwrap();
        assert_eq!(c.hca.as_ref().map(|h| h.spec()), Some("=mlx5_1:1"));
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.family, Family::V4);
        assert_eq!(c.range, Some(parse_cidr("10.1.0.0/16").unwrap()));
        // The family follows the range when not given.
        assert_eq!(env(&[(RANGE_VAR, "fd00::/64")]).unwrap().family, Family::V6);
        assert_eq!(env(&[(GID_INDEX_VAR, "-1")]).unwrap().gid_index, None);

        for (vars, name) in [
            (vec![(HCA_VAR, "^")], HCA_VAR),
            (vec![(GID_INDEX_VAR, "three")], GID_INDEX_VAR),
            (vec![(GID_INDEX_VAR, "-2")], GID_INDEX_VAR),
            (vec![(FAMILY_VAR, "AF_UNIX")], FAMILY_VAR),
            (vec![(RANGE_VAR, "10.0.0.0")], RANGE_VAR),
            (
                vec![(FAMILY_VAR, "ipv4"), (RANGE_VAR, "fd00::/64")],
                RANGE_VAR,
            ),
        ] {
            let e = env(&vars).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)));
            let e = e.to_string();
            assert!(e.contains(name), "{vars:?}: {e}");
        }
        // A hand-built mismatch is refused by choose() too.
        let c = Criteria {
            range: Some(parse_cidr("fd00::/64").unwrap()),
            ..Criteria::default()
        };
        let e = err_text(choose(&tree("mlx5"), &c));
        assert!(
            e.contains("IPv6 range but the wanted family is IPv4"),
            "{e}"
        );
    }

    #[test]
    fn describe_marks_choice() {
        let ports = tree("mlx5");
        let c = choose(&ports, &Criteria::default()).unwrap();
        let table = describe(&ports, Some(&c));
        assert!(table.starts_with("mlx5_0 port 1: ACTIVE, Ethernet, 100 Gb/s, pci 0000:17:00.0, netdev ens1f0np0 mtu 9000, guid b8ce:f603:00a2:b4a0\n"), "{table}");
        let marked: Vec<&str> = table.lines().filter(|l| l.contains("<- chosen")).collect();
        assert_eq!(marked.len(), 1, "{table}");
        assert!(marked[0].trim_start().starts_with("=> 3"), "{table}");
        assert!(marked[0].contains("192.168.1.2"), "{table}");
        assert!(table.contains("fd00::2"), "{table}");
        assert!(table.ends_with(&format!("chosen: {}\n", c.why)), "{table}");
        let plain = describe(&ports, None);
        assert!(!plain.contains("<- chosen") && plain.ends_with("chosen: none\n"));
        // Several devices, one without the choice.
        let ports = tree("two_nics");
        let c = pick("two_nics", &[(HCA_VAR, "mlx5_1")]).unwrap();
        let table = describe(&ports, Some(&c));
        assert!(table.contains("mlx5_0 port 1:") && table.contains("mlx5_1 port 1:"));
        assert_eq!(table.matches("<- chosen").count(), 1, "{table}");
        let chosen = table.lines().find(|l| l.contains("<- chosen")).unwrap();
        assert!(chosen.contains("10.1.0.5"), "{table}");
    }

    #[test]
    fn gid_entry_ip() {
        let g = |s: &str| GidEntry {
            index: 0,
            gid: s.parse().unwrap(),
            roce_v2: true,
            ndev: None,
        };
        assert_eq!(
            g("::ffff:192.168.1.2").ip(),
            "192.168.1.2".parse::<IpAddr>().unwrap()
        );
        assert_eq!(g("fd00::2").ip(), "fd00::2".parse::<IpAddr>().unwrap());
        assert!(g("fe80::1").is_link_local() && g("febf::1").is_link_local());
        assert!(!g("fec0::1").is_link_local());
        assert!(g("::").is_zero());
    }

    #[test]
    fn attribute_parsing() {
        assert_eq!(parse_state("4: ACTIVE"), ("ACTIVE".to_string(), true));
        assert_eq!(parse_state("1: DOWN"), ("DOWN".to_string(), false));
        assert_eq!(
            parse_state("5: ACTIVE_DEFER"),
            ("ACTIVE_DEFER".to_string(), false)
        );
        assert_eq!(parse_state(""), ("unknown".to_string(), false));
        assert_eq!(parse_rate("100 Gb/sec (4X EDR)"), Some(100.0));
        assert_eq!(parse_rate("2.5 Gb/sec (1X SDR)"), Some(2.5));
        assert_eq!(parse_rate("garbage"), None);
        assert_eq!(parse_rate("0 Gb/sec"), None);
        assert_eq!(index_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
    }

    #[test]
    fn missing_root_is_empty() {
        let root = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/sysfs/nonexistent"
        ));
        assert!(scan(root).unwrap().is_empty());
        // A file where the root should be is an error naming it.
        let file = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
        let e = scan(file).unwrap_err();
        assert!(e.to_string().contains("Cargo.toml"), "{e}");
    }

    #[test]
    fn real_sysfs_smoke() {
        // The scan of this machine's sysfs finds exactly the ports listed there (none
        // without RDMA hardware, each device's ports/N on a RoCE host), and the report
        // names each of them.
        let root = Path::new(SYSFS_ROOT);
        let ports = scan(root).unwrap();
        let listed: usize = std::fs::read_dir(root)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read_dir(e.path().join("ports")).ok())
                    .map(|p| p.count())
                    .sum()
            })
            .unwrap_or(0);
        assert_eq!(ports.len(), listed, "{ports:?}");
        let text = describe(&ports, None);
        for p in &ports {
            assert!(text.contains(&p.dev), "{} missing from: {text}", p.dev);
        }
        if ports.is_empty() {
            eprintln!("real_sysfs_smoke: no RDMA ports in {SYSFS_ROOT} (none on this host)");
        }
    }
}
