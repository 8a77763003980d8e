//! The TCP network's settings (`ROCCL_NSOCKS`, `ROCCL_TCP_*`), parsed once.

use crate::envvar::{self, Lookup};
use crate::error::Result;

/// Settings of the TCP network ([`TcpNet`](super::TcpNet)).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TcpSettings {
    /// Sockets per connection and direction (`ROCCL_NSOCKS`, default 2; 1 to 8, checked
    /// when the network opens).
    pub nsocks: usize,
    /// Payloads of at least this many bytes are cut over the sockets (`ROCCL_TCP_SPLIT`,
    /// default 256 KiB; at least 4 KiB is used).
    pub split: usize,
    /// `SO_SNDBUF` of sockets to a peer on this host (`ROCCL_TCP_SNDBUF`, default 256 KiB;
    /// 0: the kernel's autotuning).
    pub sndbuf: usize,
    /// Connections carry messages both ways (`ROCCL_TCP_DUPLEX`, on by default).
    pub duplex: bool,
    /// On a duplex connection, payloads up to this size travel with their header on the
    /// shared socket, where the peer's data carries their acknowledgement; larger ones with
    /// their header on the direction's own sockets (`ROCCL_TCP_DUPLEX_INLINE`, default
    /// 16 KiB). 2 ranks over loopback: 8 B–8 KiB all-reduces 10–17 % faster than over
    /// one-way connections, 32 KiB–1 MiB the same or better; bulk both ways on the shared
    /// socket is slower (the directions contend for it), and so is 32 KiB there (13.6–14.4
    /// µs against 11.8); docs/PERFORMANCE.md.
    pub duplex_inline: usize,
}

impl Default for TcpSettings {
    /// 2 sockets, split from 256 KiB, 256 KiB send buffers on this host, duplex with
    /// payloads up to 16 KiB inline.
    fn default() -> Self {
        TcpSettings {
            nsocks: 2,
            split: 256 * 1024,
            sndbuf: super::LOCAL_SNDBUF,
            duplex: true,
            duplex_inline: 16 * 1024,
        }
    }
}

impl TcpSettings {
    /// The settings `get` gives (unset: the default); a value that does not parse is an
    /// error naming the variable.
    pub fn from_lookup(get: Lookup<'_>) -> Result<TcpSettings> {
        let d = TcpSettings::default();
        Ok(TcpSettings {
            nsocks: envvar::value_in(get, "ROCCL_NSOCKS", d.nsocks)?,
            split: envvar::value_in(get, "ROCCL_TCP_SPLIT", d.split)?,
            sndbuf: envvar::value_in(get, "ROCCL_TCP_SNDBUF", d.sndbuf)?,
            duplex: envvar::switch_in(get, "ROCCL_TCP_DUPLEX", d.duplex)?,
            duplex_inline: envvar::value_in(get, "ROCCL_TCP_DUPLEX_INLINE", d.duplex_inline)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::envvar::one;

    #[test]
    fn defaults_and_good_values_are_taken() {
        let d = TcpSettings::from_lookup(&envvar::unset).unwrap();
        assert_eq!(
            (d.nsocks, d.split, d.sndbuf, d.duplex, d.duplex_inline),
            (2, 256 << 10, 256 << 10, true, 16 << 10)
        );
        let get = |k: &str| {
            match k {
                "ROCCL_NSOCKS" => Some("4"),
                "ROCCL_TCP_SPLIT" => Some("65536"),
                "ROCCL_TCP_SNDBUF" => Some("0"),
                "ROCCL_TCP_DUPLEX" => Some("off"),
                "ROCCL_TCP_DUPLEX_INLINE" => Some(" 1024 "),
                _ => None,
            }
            .map(String::from)
        };
        let s = TcpSettings::from_lookup(&get).unwrap();
        assert_eq!(
            (s.nsocks, s.split, s.sndbuf, s.duplex, s.duplex_inline),
            (4, 65536, 0, false, 1024)
        );
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (k, v) in [
            ("ROCCL_NSOCKS", "two"),
            ("ROCCL_TCP_SPLIT", "-1"),
            ("ROCCL_TCP_SNDBUF", "1M"),
            ("ROCCL_TCP_DUPLEX", "maybe"),
            ("ROCCL_TCP_DUPLEX_INLINE", "x"),
        ] {
            let e = TcpSettings::from_lookup(&one(k, v))
                .expect_err(k)
                .to_string();
            assert!(e.contains(&format!("{k}={v:?}")), "{e}");
        }
    }
}
