//! The check of every `ROCCL_*` setting at once ([`crate::envvar::SETTINGS`]), before
//! `Config::from_lookup` parses them: a bad value is refused at init even of a setting
//! that only the launcher or a tool reads.
//!
//! Most settings are checked by their entry in the table; a few take values that only the
//! layer reading them can parse (a network, an algorithm, an address family, a fault plan):
//! this module, above every such layer, holds their parsers (`PARSED_ABOVE`).

use crate::envvar::{invalid, Setting, SETTINGS};
use crate::error::Result;

/// Whether a value is accepted.
type Parser = fn(&str) -> bool;

/// The parsers of the settings whose table entry has no check of its own (`valid: None`).
const PARSED_ABOVE: &[(&str, Parser)] = &[
    ("ROCCL_NET", |v| v.parse::<crate::net::NetKind>().is_ok()),
    ("ROCCL_NETS", |v| {
        v.split(',').all(|k| {
            k.trim()
                .parse::<crate::net::NetKind>()
                .is_ok_and(|k| crate::net::NetKind::BETWEEN_HOSTS.contains(&k))
        })
    }),
    ("ROCCL_SIM", |v| {
        v.parse::<crate::net::sim::SimSpec>().is_ok()
    }),
    ("ROCCL_ALGO", |v| {
        v.eq_ignore_ascii_case("auto") || v.parse::<crate::algo::Algo>().is_ok()
    }),
    ("ROCCL_SOCKET_FAMILY", |v| {
        crate::bootstrap::ifaces::parse_family(v).is_ok()
    }),
    ("ROCCL_ROCEV2_FAULTS", |v| {
        crate::rdma::udp::Faults::parse(v).is_ok()
    }),
    ("ROCCL_IB_HCA", |v| {
        crate::rdma::select::parse_hca(v).is_ok()
    }),
    ("ROCCL_IB_ADDR_FAMILY", |v| {
        crate::rdma::select::parse_family(v).is_ok()
    }),
    ("ROCCL_IB_ADDR_RANGE", |v| {
        crate::rdma::select::parse_cidr(v).is_ok()
    }),
];

/// Whether the (trimmed, non-empty) value `v` of setting `s` is accepted.
fn accepted(s: &Setting, v: &str) -> bool {
    match s.valid {
        Some(valid) => valid(v),
        None => PARSED_ABOVE
            .iter()
            .find(|(name, _)| *name == s.name)
            .is_some_and(|(_, valid)| valid(v)),
    }
}

/// Check every setting `get` returns (the environment: `envvar::from_process`).
pub fn check_with(get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    for s in SETTINGS {
        if let Some(v) = get(s.name) {
            let t = v.trim();
            if !t.is_empty() && !accepted(s, t) {
                return Err(invalid(s.name, &v));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every setting without a check of its own has a parser here, and every parser here
    /// belongs to such a setting.
    #[test]
    fn every_setting_parsed_above_has_its_parser() {
        for s in SETTINGS.iter().filter(|s| s.valid.is_none()) {
            assert!(
                PARSED_ABOVE.iter().any(|(n, _)| *n == s.name),
                "{} has no check",
                s.name
            );
        }
        for (n, _) in PARSED_ABOVE {
            assert!(
                crate::envvar::setting(n).is_some_and(|s| s.valid.is_none()),
                "{n} is not a setting checked here"
            );
        }
    }

    #[test]
    fn every_setting_refuses_garbage_naming_itself() {
        for s in SETTINGS {
            let e = check_with(&|k| (k == s.name).then(|| "abc!".to_string()))
                .expect_err(s.name)
                .to_string();
            assert!(
                e.contains(&format!("{}=\"abc!\"", s.name)) && e.contains(s.accepts),
                "{e}"
            );
        }
    }

    #[test]
    fn defaults_and_good_values_pass() {
        assert!(check_with(&|_| None).is_ok());
        let good = [
            ("ROCCL_TIMEOUT", "2.5"),
            ("ROCCL_NET", "tcp"),
            ("ROCCL_ALGO", "auto"),
            ("ROCCL_SLICE", "256K"),
            ("ROCCL_SHM", "0"),
            ("ROCCL_IB_HCA", "mlx5_0:1"),
            ("ROCCL_ROCEV2_FAULTS", "drop=0.01,seed=7"),
            ("ROCCL_DEBUG", "info"),
            ("ROCCL_IB_GID_INDEX", "-1"),
        ];
        for (k, v) in good {
            assert!(
                check_with(&|n| (n == k).then(|| v.to_string())).is_ok(),
                "{k}={v}"
            );
        }
        for (k, v) in [
            ("ROCCL_TIMEOUT", "0"),
            ("ROCCL_TIMEOUT", "-3"),
            ("ROCCL_NSOCKS", "0"),
        ] {
            assert!(
                check_with(&|n| (n == k).then(|| v.to_string())).is_err(),
                "{k}={v}"
            );
        }
    }
}
