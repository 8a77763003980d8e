//! The userspace engine's settings (`ROCCL_ROCEV2_PORT`, `ROCCL_ROCEV2_FAULTS`,
//! `ROCCL_ROCEV2_GSO`, `ROCCL_ROCEV2_SIM_GPU`, `ROCCL_ROCEV2_TAKEOVER_US`, `ROCCL_IB_TIMEOUT`,
//! `ROCCL_TIMEOUT`), parsed once.

use std::time::Duration;

use super::Faults;
use crate::envvar::{self, Lookup};
use crate::error::{Error, Result};

/// Settings of the userspace RoCE v2 engine ([`UserVerbs`](super::UserVerbs)).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineSettings {
    /// UDP port the engine receives on (`ROCCL_ROCEV2_PORT`, default 4791; an ephemeral
    /// port when that is taken; 0: any).
    pub port: u16,
    /// Faults injected into outgoing datagrams (`ROCCL_ROCEV2_FAULTS`); `None`: none.
    pub faults: Option<Faults>,
    /// Send and receive through UDP GSO/GRO where the kernel offers them
    /// (`ROCCL_ROCEV2_GSO`, on by default); off: one packet per datagram.
    pub offload: bool,
    /// Local ACK timeout code of the engine's QPs (`ROCCL_IB_TIMEOUT`, default 12:
    /// 4.096 µs × 2^t).
    pub ib_timeout: u8,
    /// How long the application may leave the engine alone (between two calls) before the
    /// progress thread takes over receiving, acknowledging and retransmitting
    /// (`ROCCL_ROCEV2_TAKEOVER_US`; default [`TAKEOVER_DEFAULT`] or a quarter of the local
    /// ACK timeout if that is shorter; a value above that quarter is refused, so a peer
    /// waiting for an acknowledgement does not resend). Longer than a model's compute between
    /// two all-reduces, so that the thread does not wake beside it (docs/PERFORMANCE.md).
    pub takeover: Duration,
    /// `ROCCL_ROCEV2_SIM_GPU=1`: the engine poses as a NIC that reaches GPU memory: it
    /// advertises GPU pointers and dmabufs (NCCL_PTR_CUDA | NCCL_PTR_DMABUF), takes host
    /// memory registered as GPU memory, and maps registered dmabufs (memfds in tests) itself,
    /// so the GPU-direct path (no eager or inline copies, dmabuf registration, flushes
    /// through the NIC) runs without a GPU (tests/plugin/run.sh, net::rocev2 tests).
    pub sim_gpu: bool,
    /// How long QPs retransmit without progress until the network is told its
    /// communicator's deadline ([`Verbs::set_timeout`](crate::rdma::verbs::Verbs::set_timeout)):
    /// `ROCCL_TIMEOUT`, default 300 s.
    pub deadline: Duration,
}

impl Default for EngineSettings {
    /// Port 4791, no faults, GSO/GRO on, ACK timeout code 12, no simulated GPU, 300 s.
    fn default() -> Self {
        EngineSettings {
            port: crate::rdma::wire::ROCEV2_PORT,
            faults: None,
            offload: true,
            ib_timeout: 12,
            takeover: TAKEOVER_DEFAULT,
            sim_gpu: false,
            deadline: crate::os::wait::DEFAULT_TIMEOUT,
        }
    }
}

/// Default of [`EngineSettings::takeover`]: 4 ms (with the default ROCCL_IB_TIMEOUT=12, a
/// quarter of the 16.8 ms local ACK timeout). 0.5 ms before 2026-12-07: a 2-process decode
/// over the engine reached 0.77 of the no-op bound with it, 0.85 with 2 or 4 ms.
pub const TAKEOVER_DEFAULT: Duration = Duration::from_micros(4000);

impl EngineSettings {
    /// The settings `get` gives (unset: the default); a value that does not parse is an
    /// error naming the variable.
    pub fn from_lookup(get: Lookup<'_>) -> Result<EngineSettings> {
        let d = EngineSettings::default();
        let port = match get("ROCCL_ROCEV2_PORT") {
            Some(v) if !v.trim().is_empty() => v
                .trim()
                .parse::<u16>()
                .map_err(|_| Error::arg(format!("ROCCL_ROCEV2_PORT={v} is not a port number")))?,
            _ => d.port,
        };
        let faults = match get("ROCCL_ROCEV2_FAULTS") {
            Some(v) if !v.trim().is_empty() => Some(Faults::parse(&v)?),
            _ => None,
        };
        let ib_timeout = envvar::value_in(get, "ROCCL_IB_TIMEOUT", d.ib_timeout)?;
        // 4.096 µs × 2^t, the time a peer waits for an acknowledgement before it resends.
        let ack_timeout = Duration::from_nanos(4096 << ib_timeout.min(31));
        let takeover = Duration::from_micros(envvar::value_in(
            get,
            "ROCCL_ROCEV2_TAKEOVER_US",
            d.takeover.min(ack_timeout / 4).as_micros() as u64,
        )?);
        if takeover > ack_timeout / 4 {
            return Err(Error::arg(format!(
                "ROCCL_ROCEV2_TAKEOVER_US={}: the progress thread must take over within a quarter \
                 of the local ACK timeout ({:.1?} with ROCCL_IB_TIMEOUT={ib_timeout}), or peers \
                 would resend to a rank that computes: give at most {} µs, or raise ROCCL_IB_TIMEOUT",
                takeover.as_micros(),
                ack_timeout,
                (ack_timeout / 4).as_micros()
            )));
        }
        Ok(EngineSettings {
            port,
            faults,
            offload: envvar::switch_in(get, "ROCCL_ROCEV2_GSO", d.offload)?,
            ib_timeout,
            takeover,
            sim_gpu: envvar::switch_in(get, "ROCCL_ROCEV2_SIM_GPU", d.sim_gpu)?,
            deadline: crate::os::wait::timeout_in(get)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::envvar::one;

    #[test]
    fn defaults_and_good_values_are_taken() {
        let d = EngineSettings::from_lookup(&envvar::unset).unwrap();
        assert_eq!(
            (d.port, d.faults, d.offload, d.ib_timeout, d.sim_gpu),
            (4791, None, true, 12, false)
        );
        assert_eq!(
            EngineSettings::from_lookup(&one("ROCCL_ROCEV2_PORT", " 5000 "))
                .unwrap()
                .port,
            5000
        );
        let f = EngineSettings::from_lookup(&one("ROCCL_ROCEV2_FAULTS", "drop=0.5,seed=3"))
            .unwrap()
            .faults
            .unwrap();
        assert_eq!((f.drop, f.seed), (0.5, 3));
        assert!(
            !EngineSettings::from_lookup(&one("ROCCL_ROCEV2_GSO", "off"))
                .unwrap()
                .offload
        );
        assert_eq!(
            EngineSettings::from_lookup(&one("ROCCL_IB_TIMEOUT", "14"))
                .unwrap()
                .ib_timeout,
            14
        );
        assert!(
            EngineSettings::from_lookup(&one("ROCCL_ROCEV2_SIM_GPU", "1"))
                .unwrap()
                .sim_gpu
        );
    }

    #[test]
    fn takeover_fits_the_ack_timeout() {
        let d = EngineSettings::from_lookup(&envvar::unset).unwrap();
        assert_eq!(d.takeover, Duration::from_millis(4));
        // ROCCL_IB_TIMEOUT=10: 4.19 ms ACK timeout, so a quarter of it by default.
        let short = |k: &str| (k == "ROCCL_IB_TIMEOUT").then(|| "10".to_string());
        let s = EngineSettings::from_lookup(&short).unwrap();
        assert_eq!(s.takeover, Duration::from_micros(1048));
        let given = |k: &str| match k {
            "ROCCL_IB_TIMEOUT" => Some("10".to_string()),
            "ROCCL_ROCEV2_TAKEOVER_US" => Some("800".to_string()),
            _ => None,
        };
        assert_eq!(
            EngineSettings::from_lookup(&given).unwrap().takeover,
            Duration::from_micros(800)
        );
        let e = EngineSettings::from_lookup(&one("ROCCL_ROCEV2_TAKEOVER_US", "5000"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 4194 µs"), "{e}");
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (k, v) in [
            ("ROCCL_ROCEV2_PORT", "abc"),
            ("ROCCL_ROCEV2_PORT", "70000"),
            ("ROCCL_ROCEV2_FAULTS", "drop"),
            ("ROCCL_ROCEV2_GSO", "maybe"),
            ("ROCCL_IB_TIMEOUT", "abc"),
            ("ROCCL_ROCEV2_SIM_GPU", "2"),
            ("ROCCL_ROCEV2_TAKEOVER_US", "soon"),
            ("ROCCL_ROCEV2_TAKEOVER_US", "5000"),
            ("ROCCL_TIMEOUT", "abc"),
        ] {
            let e = EngineSettings::from_lookup(&one(k, v))
                .expect_err(k)
                .to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
        let e = EngineSettings::from_lookup(&one("ROCCL_ROCEV2_PORT", "abc"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ROCCL_ROCEV2_PORT=abc is not a port number"),
            "{e}"
        );
    }
}
