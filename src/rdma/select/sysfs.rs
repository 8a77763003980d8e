//! Reading the RDMA devices' ports and GID tables from sysfs ([`scan`]).

use std::cmp::Ordering;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use crate::error::{Error, Result};

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
    pub(super) fn kind(&self) -> &'static str {
        if self.roce_v2 {
            "RoCE v2"
        } else {
            "RoCE v1"
        }
    }

    /// `"192.168.1.2 on eth0"` or `"192.168.1.2"`.
    pub(super) fn addr_on(&self) -> String {
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
    pub(super) fn name(&self) -> String {
        format!("{} port {}", self.dev, self.port)
    }
}

/// Compare names so that embedded numbers sort numerically: `mlx5_2` before `mlx5_10`.
pub(super) fn natural_cmp(a: &str, b: &str) -> Ordering {
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
pub(super) fn parse_state(s: &str) -> (String, bool) {
    let name = match s.split_once(':') {
        Some((_, name)) => name.trim(),
        None => s.trim(),
    };
    let name = if name.is_empty() { "unknown" } else { name };
    (name.to_string(), name.eq_ignore_ascii_case("ACTIVE"))
}

/// The rate in Gb/s from a sysfs rate like `100 Gb/sec (4X EDR)`.
pub(super) fn parse_rate(s: &str) -> Option<f64> {
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

/// Read every port of every RDMA device under `root` (normally [`SYSFS_ROOT`](super::SYSFS_ROOT)), sorted by
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
