//! What the environment asks for ([`Criteria`]): the devices and ports allowed
//! (`ROCCL_IB_HCA`, [`parse_hca`]), a forced GID index, the address family
//! ([`parse_family`]) and range ([`parse_cidr`]).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::error::{Error, Result};

use super::{FAMILY_VAR, GID_INDEX_VAR, HCA_VAR, RANGE_VAR};

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

    /// Whether the list names several devices or ports to use (not ports to avoid): the
    /// network then has a device for each.
    pub fn lists_several(&self) -> bool {
        !self.exclude && self.items.len() > 1
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
    pub(super) fn other_var_value(self) -> &'static str {
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

/// What [`choose`](super::choose) looks for.
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
    /// The criteria `ROCCL_IB_HCA`, `ROCCL_IB_GID_INDEX`, `ROCCL_IB_ADDR_FAMILY` and
    /// `ROCCL_IB_ADDR_RANGE` give, read through `get` (`None`: unset; the process
    /// environment is [`crate::envvar::from_process`]).
    ///
    /// Blank values count as unset; `ROCCL_IB_GID_INDEX=-1` means automatic. Without
    /// `ROCCL_IB_ADDR_FAMILY`, the family is that of `ROCCL_IB_ADDR_RANGE` if set, else IPv4.
    /// Errors ([`Error::InvalidArgument`]) name the variable at fault, including a range
    /// whose family contradicts `ROCCL_IB_ADDR_FAMILY`.
    pub fn from_lookup(get: crate::envvar::Lookup<'_>) -> Result<Criteria> {
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
