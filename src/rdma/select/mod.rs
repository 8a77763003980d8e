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
//! Environment variables (parsed by [`Criteria::from_lookup`]):
//!
//! - `ROCCL_IB_HCA`: which devices/ports may be used, in `NCCL_IB_HCA` syntax ([`parse_hca`]);
//! - `ROCCL_IB_GID_INDEX`: force a GID index (`-1` or unset: automatic);
//! - `ROCCL_IB_ADDR_FAMILY`: `AF_INET`/`ipv4` (default) or `AF_INET6`/`ipv6` ([`parse_family`]);
//! - `ROCCL_IB_ADDR_RANGE`: only addresses in this prefix, e.g. `10.0.0.0/16` ([`parse_cidr`]).

mod choice;
mod criteria;
mod sysfs;
#[cfg(test)]
mod tests;

pub use choice::{choose, choose_each, describe, Choice};
pub use criteria::{parse_cidr, parse_family, parse_hca, Cidr, Criteria, Family, HcaFilter};
pub use sysfs::{scan, GidEntry, PortInfo};

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
