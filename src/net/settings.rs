//! The settings of every network and RDMA provider, parsed once ([`NetSettings`]) and
//! handed to [`open`](super::open) and the networks' constructors: no network reads the
//! environment itself.

use super::rocev2::RoceSettings;
use super::shm::ShmSettings;
use super::tcp::TcpSettings;
use crate::envvar::Lookup;
use crate::error::Result;

/// Settings of the networks and the RDMA providers they open (`ROCCL_NSOCKS`,
/// `ROCCL_TCP_*`, `ROCCL_SHM_RING`, `ROCCL_SHM_CMA`, `ROCCL_ROCEV2_*`, `ROCCL_IB_*`).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct NetSettings {
    /// The TCP network's.
    pub tcp: TcpSettings,
    /// The shared-memory network's.
    pub shm: ShmSettings,
    /// The RoCE v2 network's (userspace engine and NICs).
    pub rocev2: RoceSettings,
}

impl NetSettings {
    /// The settings `get` gives (unset: the default); a value that does not parse is an
    /// error naming the variable.
    pub fn from_lookup(get: Lookup<'_>) -> Result<NetSettings> {
        Ok(NetSettings {
            tcp: TcpSettings::from_lookup(get)?,
            shm: ShmSettings::from_lookup(get)?,
            rocev2: RoceSettings::from_lookup(get)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_network_takes_its_settings() {
        let get = |k: &str| {
            match k {
                "ROCCL_TCP_DUPLEX" => Some("0"),
                "ROCCL_SHM_RING" => Some("65536"),
                "ROCCL_ROCEV2_EAGER" => Some("4096"),
                "ROCCL_ROCEV2_GSO" => Some("off"),
                _ => None,
            }
            .map(String::from)
        };
        let s = NetSettings::from_lookup(&get).unwrap();
        assert!(!s.tcp.duplex);
        assert_eq!(s.shm.ring, 65536);
        assert_eq!(s.rocev2.eager, 4096);
        assert!(!s.rocev2.engine.offload);
        let d = NetSettings::from_lookup(&crate::envvar::unset).unwrap();
        assert!(d.tcp.duplex && d.rocev2.engine.offload);
        assert_eq!((d.shm.ring, d.rocev2.eager), (1 << 20, 16384));
    }

    #[test]
    fn a_bad_value_of_any_network_is_an_error_naming_it() {
        for (k, v) in [
            ("ROCCL_TCP_DUPLEX", "maybe"),
            ("ROCCL_SHM_RING", "3"),
            ("ROCCL_ROCEV2_EAGER", "999999"),
            ("ROCCL_ROCEV2_PORT", "abc"),
            ("ROCCL_IB_TIMEOUT", "abc"),
        ] {
            let e = NetSettings::from_lookup(&|q| (q == k).then(|| v.to_string()))
                .expect_err(k)
                .to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
    }
}
