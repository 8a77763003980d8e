//! Every `ROCCL_*` setting roccl reads from the environment, parsed strictly: a value that
//! does not parse is an error naming the variable, its value and what it accepts, never a
//! silent fallback to the default.
//!
//! This module is where the library reads the process environment ([`from_process`]);
//! elsewhere only logging (`ROCCL_DEBUG`) and the bootstrap (the launcher's variables,
//! [`crate::bootstrap::env`]; the interface to listen on; `ROCCL_ENCRYPT`) do. Settings are
//! parsed once into typed settings that travel down: [`Config::from_lookup`] (the
//! communicator's, with the networks' `NetSettings` in it) parses them from a [`Lookup`],
//! the environment or any other source, after checking every setting of [`SETTINGS`] at
//! once ([`check_with`]). What runs without a communicator takes [`process`] (read once) and
//! [`timeout`].
//!
//! [`Config::from_lookup`]: crate::Config::from_lookup
//! [`check_with`]: crate::comm::settings::check_with

use std::str::FromStr;

use crate::error::{Error, Result};

/// One environment setting: its name, what it accepts (for the error) and its check.
#[derive(Clone, Copy)]
pub struct Setting {
    /// The variable, `ROCCL_...`.
    pub name: &'static str,
    /// What it accepts, in words.
    pub accepts: &'static str,
    /// Whether a (trimmed, non-empty) value is accepted; `None` for a value that only the
    /// layer reading it can parse (a network, an algorithm, an address family...): the
    /// communicator's check of every setting (`comm::settings`) takes that layer's parser.
    pub valid: Option<fn(&str) -> bool>,
}

fn uint(v: &str) -> bool {
    v.parse::<u64>().is_ok()
}
fn bytes(v: &str) -> bool {
    parse_bytes(v).is_some()
}
fn switch(v: &str) -> bool {
    parse_switch(v).is_some()
}
fn one_of(v: &str, words: &[&str]) -> bool {
    words.iter().any(|w| w.eq_ignore_ascii_case(v))
}

/// Bytes written as a number with an optional `K`, `M` or `G` suffix (powers of 1024), as
/// the `ROCCL_*` size settings and the tools take them; `None` when it is not one.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

/// `0`/`1` and their spellings.
pub fn parse_switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Some(true),
        "0" | "off" | "false" | "no" => Some(false),
        _ => None,
    }
}

const SWITCH: &str = "0 or 1 (also off/on, false/true, no/yes)";
const UINT: &str = "a whole number";
const BYTES: &str = "bytes: a whole number, optionally with a K, M or G suffix (e.g. 64K, 4M)";

/// Every setting roccl reads (the launcher variables aside; see the module docs).
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "ROCCL_NET",
        accepts: "auto, tcp, rocev2, verbs, shm or sim",
        valid: None,
    },
    Setting {
        name: "ROCCL_SIM",
        accepts: "the simulated cluster (ROCCL_NET=sim) as name=value pairs, comma-separated: hosts, ranks_per_host, nic_gbps, nic_us, local_gbps, local_us, msg_us, reduce_gbs",
        valid: None,
    },
    Setting {
        name: "ROCCL_ALGO",
        accepts: "auto, ring, tree, direct, doubling, twoshot, shm1, shm2, hier or bruck",
        valid: None,
    },
    Setting {
        name: "ROCCL_TIMEOUT",
        accepts: "seconds, a number above 0 (e.g. 300 or 2.5)",
        valid: Some(|v| v.parse::<f64>().is_ok_and(|t| t > 0.0 && t.is_finite())),
    },
    Setting {
        name: "ROCCL_SPIN_US",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_YIELD_US",
        accepts: UINT,
        valid: Some(uint),
    },
    // Read by the torch backend (ffi/torch/csrc/backend.cpp): how long single sends and
    // receives are held back to be grouped with those queued behind them.
    Setting {
        name: "ROCCL_TORCH_P2P_HOLD_US",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_DEBUG",
        accepts: "WARN or INFO (also VERSION, TRACE, DEBUG as NCCL_DEBUG)",
        valid: Some(|v| one_of(v, &["WARN", "INFO", "VERSION", "TRACE", "DEBUG"])),
    },
    Setting {
        name: "ROCCL_SLICE",
        accepts: BYTES,
        valid: Some(bytes),
    },
    Setting {
        name: "ROCCL_DEPTH",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_NCHANNELS",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_CONNECT",
        accepts: "all or lazy",
        valid: Some(|v| one_of(v, &["all", "init", "lazy", "first-use"])),
    },
    Setting {
        name: "ROCCL_GPU_DIRECT",
        accepts: "auto, 1 or 0",
        valid: Some(|v| v.eq_ignore_ascii_case("auto") || switch(v)),
    },
    Setting {
        name: "ROCCL_GPU_DIRECT_MIN",
        accepts: BYTES,
        valid: Some(bytes),
    },
    Setting {
        name: "ROCCL_HOSTID",
        accepts: "a name for this rank's host: up to 255 letters, digits and - _ . :",
        valid: Some(|v| {
            v.len() <= 255
                && v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
        }),
    },
    Setting {
        name: "ROCCL_HIER",
        accepts: "auto, 1 or 0",
        valid: Some(|v| v.eq_ignore_ascii_case("auto") || switch(v)),
    },
    Setting {
        name: "ROCCL_RING_WINDOW",
        accepts: BYTES,
        valid: Some(bytes),
    },
    Setting {
        name: "ROCCL_STREAM_CHUNK",
        accepts: BYTES,
        valid: Some(bytes),
    },
    Setting {
        name: "ROCCL_CALIBRATE",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_DETERMINISTIC",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_NETS",
        accepts: "networks between hosts to choose among per peer and call size, comma-separated, the main one first (tcp, rocev2, verbs), e.g. tcp,rocev2",
        valid: None,
    },
    Setting {
        name: "ROCCL_CPU_BIND",
        accepts: "auto, 1 or 0",
        valid: Some(|v| v.eq_ignore_ascii_case("auto") || switch(v)),
    },
    Setting {
        name: "ROCCL_MEASURE",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_SHM",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_SHM_SLOT",
        accepts: "a multiple of 4096 from 4096 to 67108864 bytes",
        valid: Some(|v| {
            v.parse::<usize>()
                .is_ok_and(|n| n % 4096 == 0 && (4096..=64 << 20).contains(&n))
        }),
    },
    Setting {
        name: "ROCCL_SHM_RING",
        accepts: "a power of two from 65536 to 1073741824 bytes",
        valid: Some(|v| {
            v.parse::<usize>()
                .is_ok_and(|n| n.is_power_of_two() && (1 << 16..=1 << 30).contains(&n))
        }),
    },
    Setting {
        name: "ROCCL_SHM_CMA",
        accepts: "bytes from which messages are copied once (a whole number; 0: off)",
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_NSOCKS",
        accepts: "a whole number of sockets from 1",
        valid: Some(|v| v.parse::<usize>().is_ok_and(|n| n >= 1)),
    },
    Setting {
        name: "ROCCL_TCP_SPLIT",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_TCP_DUPLEX",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_METRICS_ADDR",
        accepts: "host:port, or a port (0: any free port), for GET /metrics and /status",
        valid: Some(|v| {
            v.parse::<u16>().is_ok()
                || v
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        }),
    },
    Setting {
        name: "ROCCL_STUCK_WARN",
        accepts: "seconds, a number above 0: a call without progress for that long logs what it waits on (default a third of ROCCL_TIMEOUT)",
        valid: Some(|v| v.parse::<f64>().is_ok_and(|t| t > 0.0 && t.is_finite())),
    },
    Setting {
        name: "ROCCL_SUSPEND_WAIT",
        accepts: "seconds, 0 or more: how long ncclCommSuspend with NCCL_SUSPEND_MEM waits for peers that suspend too, to close the connections idle at both ends (default 1; 0 keeps every connection)",
        valid: Some(|v| v.parse::<f64>().is_ok_and(|t| t >= 0.0 && t.is_finite())),
    },
    Setting {
        name: "ROCCL_ENCRYPT",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_TCP_DUPLEX_INLINE",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_TCP_SNDBUF",
        accepts: "bytes, a whole number (0: the kernel's autotuning)",
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_SOCKET_FAMILY",
        accepts: "AF_INET, AF_INET6 or any (also ipv4, ipv6, 4, 6)",
        valid: None,
    },
    Setting {
        name: "ROCCL_ROCEV2_PORT",
        accepts: "a UDP port number, 0 to 65535",
        valid: Some(|v| v.parse::<u16>().is_ok()),
    },
    Setting {
        name: "ROCCL_ROCEV2_FAULTS",
        accepts: "drop=P,dup=P,reorder=P,corrupt=P,seed=N",
        valid: None,
    },
    Setting {
        name: "ROCCL_ROCEV2_GSO",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_ROCEV2_EAGER",
        accepts: "bytes, 0 to 65536 (0: off)",
        valid: Some(|v| v.parse::<u32>().is_ok_and(|n| n <= 65536)),
    },
    Setting {
        name: "ROCCL_ROCEV2_SIM_GPU",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_ROCEV2_TAKEOVER_US",
        accepts: "microseconds, at most a quarter of the local ACK timeout",
        valid: Some(|v| v.parse::<u64>().is_ok()),
    },
    Setting {
        name: "ROCCL_IB_TIMEOUT",
        accepts: "an IB timeout code, 1 to 31 (4.096 us x 2^t)",
        valid: Some(|v| v.parse::<u8>().is_ok_and(|t| (1..=31).contains(&t))),
    },
    Setting {
        name: "ROCCL_IB_INLINE",
        accepts: "bytes of inline data, 0 to 4096",
        valid: Some(|v| v.parse::<u32>().is_ok_and(|n| n <= 4096)),
    },
    Setting {
        name: "ROCCL_IB_REG_CACHE",
        accepts: "0 or 1",
        valid: Some(|v| v == "0" || v == "1"),
    },
    Setting {
        name: "ROCCL_IB_KICK_MS",
        accepts: "milliseconds, 0 to 3600000 (0: never kick)",
        valid: Some(|v| v.parse::<u32>().is_ok_and(|n| n <= 3_600_000)),
    },
    Setting {
        name: "ROCCL_IB_RETRY_CNT",
        accepts: "0 to 7",
        valid: Some(|v| v.parse::<u8>().is_ok_and(|t| t <= 7)),
    },
    Setting {
        name: "ROCCL_IB_TC",
        accepts: "a traffic class, 0 to 255",
        valid: Some(|v| v.parse::<u8>().is_ok()),
    },
    Setting {
        name: "ROCCL_IB_SL",
        accepts: "a service level, 0 to 15",
        valid: Some(|v| v.parse::<u8>().is_ok_and(|t| t <= 15)),
    },
    Setting {
        name: "ROCCL_IB_RELAXED_ORDERING",
        accepts: SWITCH,
        valid: Some(switch),
    },
    Setting {
        name: "ROCCL_IB_GID_INDEX",
        accepts: "a GID index, or -1 for automatic",
        valid: Some(|v| v == "-1" || v.parse::<u32>().is_ok()),
    },
    Setting {
        name: "ROCCL_IB_HCA",
        accepts: "devices and ports in NCCL_IB_HCA syntax (e.g. mlx5_0:1,mlx5_1 or ^mlx5_2); for rocev2, interfaces or addresses (eth0,eth1)",
        valid: None,
    },
    Setting {
        name: "ROCCL_IB_QPS_PER_CONNECTION",
        accepts: "queue pairs per connection, 1 to 8",
        valid: Some(|v| v.parse::<usize>().is_ok_and(|n| (1..=8).contains(&n))),
    },
    Setting {
        name: "ROCCL_IB_ADDR_FAMILY",
        accepts: "AF_INET or AF_INET6 (also ipv4, ipv6, 4, 6)",
        valid: None,
    },
    Setting {
        name: "ROCCL_IB_ADDR_RANGE",
        accepts: "an address prefix, e.g. 10.0.0.0/16",
        valid: None,
    },
    Setting {
        name: "ROCCL_DEVICE",
        accepts: "auto, hip, cuda, sim or none",
        valid: Some(|v| one_of(v, &["auto", "hip", "cuda", "sim", "none"])),
    },
    Setting {
        name: "ROCCL_SIM_DELAY_US",
        accepts: UINT,
        valid: Some(uint),
    },
    Setting {
        name: "ROCCL_APU_DEVICE_MEMORY",
        accepts: "in-place or staged",
        valid: Some(|v| one_of(v, &["in-place", "staged"])),
    },
    Setting {
        name: "ROCCL_NCCL_VERSION",
        accepts: "an NCCL version code of at least 20000 (e.g. 22005)",
        valid: Some(|v| v.parse::<i32>().is_ok_and(|n| n >= 20000)),
    },
];

/// The entry of setting `name`.
pub fn setting(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

/// The error for `name=value`.
pub fn invalid(name: &str, value: &str) -> Error {
    Error::Setting {
        name: name.to_string(),
        value: value.to_string(),
        accepts: setting(name)
            .map_or("another value", |s| s.accepts)
            .to_string(),
    }
}

/// The value of `name`, trimmed; `None` when unset or blank.
pub fn raw(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `name` parsed as `T` (`None` when unset or blank); a value that does not parse is an error.
pub fn get<T: FromStr>(name: &str) -> Result<Option<T>> {
    match raw(name) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| invalid(name, &v)),
    }
}

/// `name` parsed as `T`, or `default` when unset. For readers that cannot fail: a value that
/// does not parse was refused by [`check_with`](crate::comm::settings::check_with) at init; reached without init, it is reported
/// (WARN) and the default used.
pub fn value_or<T: FromStr>(name: &str, default: T) -> T {
    match get(name) {
        Ok(v) => v.unwrap_or(default),
        Err(e) => {
            crate::log::log(
                crate::log::Level::Warn,
                format_args!("{e}; using the default"),
            );
            default
        }
    }
}

/// The switch `name` (see [`parse_switch`]), or `default` when unset; a value that is not a
/// switch is logged and gives the default (init refuses it before, see
/// [`check_with`](crate::comm::settings::check_with)).
pub fn switch_or(name: &str, default: bool) -> bool {
    switch_value(name, std::env::var(name).ok(), default)
}

fn switch_value(name: &str, value: Option<String>, default: bool) -> bool {
    match value {
        None => default,
        Some(v) => parse_switch(&v).unwrap_or_else(|| {
            crate::log::log(
                crate::log::Level::Warn,
                format_args!(
                    "{name}={v:?} is not 0/1, off/on, false/true or no/yes; using the default"
                ),
            );
            default
        }),
    }
}

/// Where settings come from: a function from a variable's name to its value. The process
/// environment is [`from_process`]; a `Config` built in code, or a test, gives its own.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment: the one place the library's settings are read from it (the
/// launcher's variables aside, [`crate::bootstrap::env`], and logging's `ROCCL_DEBUG`).
pub fn from_process(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// No setting set: every default.
pub fn unset(_: &str) -> Option<String> {
    None
}

/// `name` from `get`, trimmed; `None` when unset or blank.
pub fn raw_in(get: Lookup<'_>, name: &str) -> Option<String> {
    get(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `name` from `get` parsed as `T` (`None` when unset or blank); a value that does not
/// parse is an error naming the variable, its value and what it accepts.
pub fn get_in<T: FromStr>(get: Lookup<'_>, name: &str) -> Result<Option<T>> {
    match raw_in(get, name) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| invalid(name, &v)),
    }
}

/// `name` from `get` parsed as `T`, or `default` when unset; strict as [`get_in`].
pub fn value_in<T: FromStr>(get: Lookup<'_>, name: &str, default: T) -> Result<T> {
    Ok(get_in(get, name)?.unwrap_or(default))
}

/// The switch `name` from `get` (see [`parse_switch`]), or `default` when unset; strict.
pub fn switch_in(get: Lookup<'_>, name: &str, default: bool) -> Result<bool> {
    match raw_in(get, name) {
        None => Ok(default),
        Some(v) => parse_switch(&v).ok_or_else(|| invalid(name, &v)),
    }
}

/// The byte count `name` from `get` (see [`parse_bytes`]); `None` when unset; strict.
pub fn bytes_in(get: Lookup<'_>, name: &str) -> Result<Option<usize>> {
    match raw_in(get, name) {
        None => Ok(None),
        Some(v) => parse_bytes(&v).map(Some).ok_or_else(|| invalid(name, &v)),
    }
}

/// The deadline without progress unless `ROCCL_TIMEOUT` says otherwise.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// `ROCCL_TIMEOUT` (seconds, above 0) from `get`, or [`DEFAULT_TIMEOUT`].
pub fn timeout_in(get: Lookup<'_>) -> Result<std::time::Duration> {
    match get_in::<f64>(get, "ROCCL_TIMEOUT")? {
        None => Ok(DEFAULT_TIMEOUT),
        Some(s) => Ok(std::time::Duration::from_secs_f64(s.max(1e-3))),
    }
}

/// `ROCCL_TIMEOUT` of the process, as it is now: the deadline of what runs without a
/// communicator (tools, tests, the plugin's flush); a communicator's parts take its own
/// (`Config::waiter`). A value that does not parse gives the default (init refuses it).
pub fn timeout() -> std::time::Duration {
    timeout_in(&from_process).unwrap_or(DEFAULT_TIMEOUT)
}

/// Settings of the process rather than of one communicator, for code that runs without
/// one (the stream-ordered operations on raw memory, the device runtimes): read from the
/// environment once, at first use. Every rank must give them alike.
#[derive(Clone, Debug)]
pub struct Process {
    /// Chunk size of pipelined stream-ordered calls (`ROCCL_STREAM_CHUNK` bytes, `K`/`M`
    /// suffixes; default 4 MiB; 0: never split), or why the value was refused.
    pub stream_chunk: std::result::Result<usize, String>,
    /// `ROCCL_APU_DEVICE_MEMORY=in-place`: an integrated GPU's device memory that the CPU
    /// can read is used in place (experimental; docs/GPU.md).
    pub apu_in_place: bool,
}

impl Process {
    /// The process settings `get` gives.
    pub fn from_lookup(get: Lookup<'_>) -> Process {
        Process {
            stream_chunk: match get("ROCCL_STREAM_CHUNK") {
                None => Ok(4 << 20),
                Some(v) => parse_bytes(&v).ok_or_else(|| {
                    format!(
                        "ROCCL_STREAM_CHUNK={v}: expected bytes such as 4M, 512K or 0 (no pipelining)"
                    )
                }),
            },
            apu_in_place: get("ROCCL_APU_DEVICE_MEMORY").is_some_and(|v| v.trim() == "in-place"),
        }
    }
}

/// This process's [`Process`] settings (read at the first call).
pub fn process() -> &'static Process {
    static PROCESS: std::sync::OnceLock<Process> = std::sync::OnceLock::new();
    PROCESS.get_or_init(|| Process::from_lookup(&from_process))
}

/// A lookup where only `name` is set, to `value` (tests of the settings' parsers).
#[cfg(test)]
pub(crate) fn one(name: &'static str, value: &'static str) -> impl Fn(&str) -> Option<String> {
    move |q| (q == name).then(|| value.to_string())
}

/// A lookup where the `pairs` (name, value) are set (tests of the settings' parsers).
#[cfg(test)]
pub(crate) fn pairs(
    pairs: &'static [(&'static str, &'static str)],
) -> impl Fn(&str) -> Option<String> {
    move |q| {
        pairs
            .iter()
            .find(|(n, _)| *n == q)
            .map(|(_, v)| v.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The readers of switches take every spelling the init check accepts (`off` used to
    /// pass the check and then be ignored by readers that looked for `0` only).
    #[test]
    fn switches_read_as_they_are_checked() {
        for (v, want) in [
            ("0", false),
            ("off", false),
            ("OFF", false),
            ("No", false),
            ("false", false),
            ("1", true),
            ("on", true),
            ("Yes", true),
        ] {
            assert!(switch(v), "{v}");
            assert_eq!(switch_value("X", Some(v.into()), !want), want, "{v}");
        }
        assert!(switch_value("X", None, true));
        assert!(!switch_value("X", Some("maybe".into()), false));
    }

    /// The launcher variables (rank, size, root), read by the bootstrap, and free-form
    /// paths (`ROCCL_TRACE`): not settings with a check.
    const LAUNCHER: [&str; 9] = [
        "ROCCL_TRACE",
        "ROCCL_RANK",
        "ROCCL_NRANKS",
        "ROCCL_ROOT",
        "ROCCL_ROOT_PORT",
        "ROCCL_UNIQUE_ID",
        "ROCCL_JOB_SECRET",
        "ROCCL_JOB_SECRET_FILE",
        "ROCCL_SOCKET_IFNAME",
    ];

    /// README's table names every setting and launcher variable.
    #[test]
    fn readme_lists_every_setting() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let missing: Vec<&str> = SETTINGS
            .iter()
            .map(|s| s.name)
            .chain(LAUNCHER)
            .filter(|n| !readme.contains(&format!("`{n}`")))
            .collect();
        assert!(missing.is_empty(), "not in README.md: {missing:?}");
    }

    /// Every `ROCCL_*` name in the sources is a setting here or a launcher variable, so that a
    /// new setting cannot be read without strict checking.
    #[test]
    fn every_variable_read_is_listed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        // Internal variables besides the launcher's: a test hook and the launcher's own.
        let launcher: Vec<&str> = LAUNCHER
            .into_iter()
            .chain(["ROCCL_SYSFS_ROOT", "ROCCL_PERF_CPU", "ROCCL_PERF_LAUNCHED"])
            .collect();
        let mut missing = Vec::new();
        let mut stack = vec![root.join("src"), root.join("ffi")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs" || x == "cpp") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    if p.ends_with("envvar.rs") {
                        continue;
                    }
                    // Names as whole string literals: what the readers look up.
                    for (i, _) in text.match_indices("\"ROCCL_") {
                        let name: String = text[i + 1..]
                            .chars()
                            .take_while(|c| {
                                c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_'
                            })
                            .collect();
                        let whole = text[i + 1 + name.len()..].starts_with('"');
                        if whole && setting(&name).is_none() && !launcher.contains(&name.as_str()) {
                            missing.push(format!("{name} ({})", p.display()));
                        }
                    }
                }
            }
        }
        assert!(missing.is_empty(), "read but not in SETTINGS: {missing:?}");
    }
}
