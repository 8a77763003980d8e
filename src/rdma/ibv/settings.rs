//! The verbs provider's settings (`ROCCL_IB_TC`, `ROCCL_IB_SL`, …), parsed once.

use crate::envvar::Lookup;
use crate::error::{Error, Result};

/// Settings of the verbs provider: its QPs' and registrations'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IbSettings {
    /// Traffic class (DSCP << 2 | ECN) of the GRH, `ROCCL_IB_TC`.
    pub tc: u8,
    /// Service level, `ROCCL_IB_SL` (0–15).
    pub sl: u8,
    /// Local ACK timeout code, `ROCCL_IB_TIMEOUT` (4.096 µs × 2^t; 1–31).
    pub timeout: u8,
    /// Transport retries, `ROCCL_IB_RETRY_CNT` (0–7).
    pub retry_cnt: u8,
    /// Inline data asked for at QP creation, `ROCCL_IB_INLINE`.
    pub inline: u32,
    /// Keep registrations past their requests, `ROCCL_IB_REG_CACHE=1`.
    pub reg_cache: bool,
    /// Register memory with relaxed ordering where the device allows it,
    /// `ROCCL_IB_RELAXED_ORDERING` (on by default).
    pub relaxed: bool,
    /// How long a closing QP waits for its sends to be acknowledged until the network is
    /// told its communicator's deadline (`ROCCL_TIMEOUT`, default 300 s).
    pub deadline: std::time::Duration,
    /// Milliseconds a QP's sends may sit outstanding with nothing posted or completed before
    /// the provider kicks the device's requester by ringing the QP's doorbell (and again
    /// each such while until they move), `ROCCL_IB_KICK_MS` (0: never). Unset: 1000 on Linux soft-RoCE, whose requester can
    /// stall (`ibv::kick`), never on other devices.
    pub kick_ms: Option<u32>,
}

impl Default for IbSettings {
    /// Traffic class 0, service level 0, timeout 20, 7 retries, 220 bytes inline, no
    /// registration cache, relaxed ordering, 300 s of deadline, kicks as the device needs.
    fn default() -> Self {
        IbSettings::from_lookup(&crate::envvar::unset).expect("the defaults parse")
    }
}

impl IbSettings {
    /// The settings `get` gives (unset: the default; the process environment is
    /// [`crate::envvar::from_process`]); a value out of range is an error naming it.
    pub fn from_lookup(get: Lookup<'_>) -> Result<IbSettings> {
        let num = |k: &str, d: u32, max: u32| -> Result<u32> {
            // Blank counts as unset, as for every setting.
            match get(k).filter(|v| !v.trim().is_empty()) {
                None => Ok(d),
                Some(v) => match v.trim().parse::<u32>() {
                    Ok(n) if n <= max => Ok(n),
                    _ => Err(Error::arg(format!(
                        "{k}={v}: expected a number from 0 to {max}"
                    ))),
                },
            }
        };
        let timeout = num("ROCCL_IB_TIMEOUT", 20, 31)?;
        if timeout == 0 {
            return Err(Error::arg(
                "ROCCL_IB_TIMEOUT=0 would wait forever for acknowledgements: use 1–31 (default 20, about 4 s)",
            ));
        }
        Ok(IbSettings {
            tc: num("ROCCL_IB_TC", 0, 255)? as u8,
            sl: num("ROCCL_IB_SL", 0, 15)? as u8,
            timeout: timeout as u8,
            retry_cnt: num("ROCCL_IB_RETRY_CNT", 7, 7)? as u8,
            inline: num("ROCCL_IB_INLINE", 220, 4096)?,
            reg_cache: num("ROCCL_IB_REG_CACHE", 0, 1)? == 1,
            relaxed: crate::envvar::switch_in(get, "ROCCL_IB_RELAXED_ORDERING", true)?,
            deadline: crate::os::wait::timeout_in(get)?,
            kick_ms: match get("ROCCL_IB_KICK_MS").filter(|v| !v.trim().is_empty()) {
                None => None,
                Some(_) => Some(num("ROCCL_IB_KICK_MS", 0, 3_600_000)?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn settings_from_the_environment() {
        let s = IbSettings::from_lookup(&|_| None).unwrap();
        assert_eq!(
            (s.tc, s.sl, s.timeout, s.retry_cnt, s.reg_cache),
            (0, 0, 20, 7, false)
        );
        let m: HashMap<&str, &str> = [
            ("ROCCL_IB_TC", "106"),
            ("ROCCL_IB_SL", "3"),
            ("ROCCL_IB_TIMEOUT", "14"),
            ("ROCCL_IB_RETRY_CNT", "5"),
            ("ROCCL_IB_INLINE", "0"),
            ("ROCCL_IB_KICK_MS", "250"),
        ]
        .into();
        let s = IbSettings::from_lookup(&|k| m.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(
            (s.tc, s.sl, s.timeout, s.retry_cnt, s.inline, s.kick_ms),
            (106, 3, 14, 5, 0, Some(250))
        );
        assert_eq!(IbSettings::default().kick_ms, None);
        assert!(s.relaxed && IbSettings::default().relaxed);
        let off = |k: &str| (k == "ROCCL_IB_RELAXED_ORDERING").then(|| "off".to_string());
        assert!(!IbSettings::from_lookup(&off).unwrap().relaxed);
        for (k, v) in [
            ("ROCCL_IB_SL", "16"),
            ("ROCCL_IB_TC", "256"),
            ("ROCCL_IB_TIMEOUT", "0"),
            ("ROCCL_IB_TIMEOUT", "x"),
            ("ROCCL_IB_RETRY_CNT", "8"),
            ("ROCCL_IB_RELAXED_ORDERING", "maybe"),
            ("ROCCL_IB_KICK_MS", "-1"),
        ] {
            let e = IbSettings::from_lookup(&|q| (q == k).then(|| v.to_string())).unwrap_err();
            assert!(e.to_string().contains(k), "{e}");
        }
    }
}
