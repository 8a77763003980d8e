//! The RoCE v2 network's settings (`ROCCL_ROCEV2_EAGER`, `ROCCL_IB_QPS_PER_CONNECTION`,
//! `ROCCL_IB_HCA`) and those of the RDMA providers it opens, parsed once.

use super::eager::EAGER_DEFAULT;
use crate::envvar::{self, Lookup};
use crate::error::Result;
use crate::rdma::select::{Criteria, HCA_VAR};
use crate::rdma::udp::EngineSettings;

/// Settings of the RoCE v2 network ([`RoceNet`](super::RoceNet)) and of the providers it
/// opens.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RoceSettings {
    /// Largest eager message, in bytes (`ROCCL_ROCEV2_EAGER`, default 16384; 0 to 65536,
    /// 0: off): a message up to this size is sent at once into one of the receiver's
    /// bounce buffers, without waiting for a clear-to-send.
    pub eager: u32,
    /// Queue pairs per connection (`ROCCL_IB_QPS_PER_CONNECTION`, 1 to 8; default 1).
    pub qps: usize,
    /// `ROCCL_IB_HCA` as given (trimmed; `None`: unset or blank): for the userspace engine,
    /// the interfaces or addresses to run an engine on; for NICs, the filter
    /// [`criteria`](Self::criteria) holds parsed.
    pub hca: Option<String>,
    /// The userspace engine's settings (`ROCCL_ROCEV2_PORT`, `ROCCL_ROCEV2_FAULTS`,
    /// `ROCCL_ROCEV2_GSO`, `ROCCL_ROCEV2_SIM_GPU`, `ROCCL_IB_TIMEOUT`).
    pub engine: EngineSettings,
    /// How NICs, ports and GIDs are chosen (`ROCCL_IB_HCA`, `ROCCL_IB_GID_INDEX`,
    /// `ROCCL_IB_ADDR_FAMILY`, `ROCCL_IB_ADDR_RANGE`).
    pub criteria: Criteria,
    /// The verbs provider's settings (`ROCCL_IB_TC`, `ROCCL_IB_SL`, `ROCCL_IB_TIMEOUT`,
    /// `ROCCL_IB_RETRY_CNT`, `ROCCL_IB_INLINE`, `ROCCL_IB_REG_CACHE`,
    /// `ROCCL_IB_RELAXED_ORDERING`).
    #[cfg(feature = "verbs")]
    pub ib: crate::rdma::ibv::IbSettings,
}

impl Default for RoceSettings {
    /// Eager messages up to 16 KiB, one queue pair per connection, every interface and NIC,
    /// and the providers' defaults.
    fn default() -> Self {
        RoceSettings {
            eager: EAGER_DEFAULT,
            qps: 1,
            hca: None,
            engine: EngineSettings::default(),
            criteria: Criteria::default(),
            #[cfg(feature = "verbs")]
            ib: crate::rdma::ibv::IbSettings::default(),
        }
    }
}

impl RoceSettings {
    /// The settings `get` gives (unset: the default); a value that does not parse is an
    /// error naming the variable.
    pub fn from_lookup(get: Lookup<'_>) -> Result<RoceSettings> {
        let d = RoceSettings::default();
        Ok(RoceSettings {
            eager: match get("ROCCL_ROCEV2_EAGER") {
                Some(v) if !v.trim().is_empty() => super::eager::parse_eager(&v)?,
                _ => d.eager,
            },
            qps: match get(super::QPS_VAR) {
                Some(v) if !v.trim().is_empty() => super::parse_qps(&v)?,
                _ => d.qps,
            },
            hca: envvar::raw_in(get, HCA_VAR),
            engine: EngineSettings::from_lookup(get)?,
            criteria: Criteria::from_lookup(get)?,
            #[cfg(feature = "verbs")]
            ib: crate::rdma::ibv::IbSettings::from_lookup(get)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::envvar::one;

    #[test]
    fn defaults_and_good_values_are_taken() {
        let d = RoceSettings::from_lookup(&envvar::unset).unwrap();
        assert_eq!((d.eager, d.qps, d.hca.as_deref()), (16384, 1, None));
        assert_eq!(d.criteria, Criteria::default());
        assert_eq!(d.engine.port, EngineSettings::default().port);
        let s = RoceSettings::from_lookup(&one("ROCCL_ROCEV2_EAGER", "0")).unwrap();
        assert_eq!(s.eager, 0);
        let s = RoceSettings::from_lookup(&one("ROCCL_IB_QPS_PER_CONNECTION", " 3 ")).unwrap();
        assert_eq!(s.qps, 3);
        let s = RoceSettings::from_lookup(&one("ROCCL_IB_HCA", " 127.0.0.1,127.0.0.2 ")).unwrap();
        assert_eq!(s.hca.as_deref(), Some("127.0.0.1,127.0.0.2"));
        assert!(s.criteria.hca.is_some());
        let s = RoceSettings::from_lookup(&one("ROCCL_ROCEV2_PORT", "5000")).unwrap();
        assert_eq!(s.engine.port, 5000);
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        let e = RoceSettings::from_lookup(&one("ROCCL_ROCEV2_EAGER", "999999"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ROCCL_ROCEV2_EAGER=999999: want the largest eager message"),
            "{e}"
        );
        for (k, v) in [
            ("ROCCL_ROCEV2_EAGER", "x"),
            ("ROCCL_IB_QPS_PER_CONNECTION", "9"),
            ("ROCCL_IB_QPS_PER_CONNECTION", "0"),
            ("ROCCL_ROCEV2_PORT", "abc"),
            ("ROCCL_IB_TIMEOUT", "abc"),
            ("ROCCL_IB_ADDR_FAMILY", "AF_UNIX"),
        ] {
            let e = RoceSettings::from_lookup(&one(k, v))
                .expect_err(k)
                .to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
    }
}
