//! Joining a communicator from the launcher's environment.
//!
//! A process started by a launcher finds three things in its environment: its rank, the number
//! of ranks, and where the root (the rendezvous server) listens. [`from_env`] reads them,
//! following the conventions of roccl itself, torchrun, Open MPI, MPICH (Hydra) and Slurm.
//!
//! # Rank and size
//!
//! The first convention whose *rank* variable is set wins:
//!
//! | launcher     | rank                   | size                   |
//! |--------------|------------------------|------------------------|
//! | `"roccl"`    | `ROCCL_RANK`           | `ROCCL_NRANKS`         |
//! | `"torchrun"` | `RANK`                 | `WORLD_SIZE`           |
//! | `"ompi"`     | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` |
//! | `"mpich"`    | `PMI_RANK`             | `PMI_SIZE`             |
//! | `"slurm"`    | `SLURM_PROCID`         | `SLURM_NTASKS`         |
//!
//! The MPI launchers come before Slurm because `mpirun` is often run inside a Slurm
//! allocation: its ranks then inherit `SLURM_PROCID` from the batch script (0 for every rank on
//! the first node) or from the per-node daemon step, and only the MPI variables are right. The
//! innermost launcher sets the most specific variables, and it is checked first.
//!
//! # Root
//!
//! Checked in this order:
//!
//! 1. `ROCCL_UNIQUE_ID`: a full unique id, 256 hex characters ([`Root::UniqueIdHex`]); the root
//!    is hosted by whoever created the id (e.g. the `roccl-perf` launcher).
//! 2. `ROCCL_ROOT=host:port` (or `[ipv6-address]:port`).
//! 3. torchrun's `MASTER_ADDR`, with port `MASTER_PORT + 1`: torchrun's own TCPStore normally
//!    listens on `MASTER_PORT` itself, so roccl's root takes the next port. `ROCCL_ROOT_PORT`
//!    overrides the port.
//! 4. Under Slurm (launcher `"slurm"` only): the first host of `SLURM_STEP_NODELIST` (else
//!    `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`), where Slurm places task 0 with its default
//!    distributions; port `ROCCL_ROOT_PORT` if set, else
//!    `29400 + (SLURM_JOB_ID + SLURM_STEP_ID) % 1000`. The port is thus the same on every task
//!    of a step without any communication, and differs between consecutive steps of a job (and
//!    usually between jobs sharing a node). With an arbitrary task placement, set `ROCCL_ROOT`.
//! 5. A single rank (`nranks == 1`) with none of the above: `127.0.0.1` port 0 (any free port);
//!    nobody needs to find it.
//!
//! Otherwise (e.g. `mpirun` without `ROCCL_ROOT` or `MASTER_ADDR`) it is an error: MPI
//! launchers publish no address roccl could use.
//!
//! By convention the rank 0 process hosts the root listener on a [`Root::Addr`].
//!
//! # Job secret
//!
//! With an address root, every rank computes the unique id from the address; what proves
//! that a process belongs to the job is the secret in `ROCCL_JOB_SECRET` (or in the file
//! `ROCCL_JOB_SECRET_FILE` names), the same on every rank ([`job_secret`]). Without one,
//! anyone who can reach the root's port can join (as with NCCL): init says so once.
//!
//! Variables set to an empty (or blank) value count as unset; values are trimmed. Every error is
//! an [`Error::InvalidArgument`] saying what was missing or wrong and how to fix it.

use std::net::Ipv6Addr;

use crate::error::{Error, Result};

/// Where the root (rendezvous server) is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Root {
    /// `host:port`; by convention the rank 0 process hosts the root listener on this port.
    ///
    /// `host` is a host name or an IP address, without brackets for IPv6 (`::1`, possibly with
    /// a zone: `fe80::1%eth0`). Port 0 (only for a single rank) means any free port.
    Addr {
        /// Host name or IP address (IPv6 without brackets).
        host: String,
        /// TCP port.
        port: u16,
    },
    /// A full unique id given as 256 hex chars in `ROCCL_UNIQUE_ID` (the root is hosted by
    /// whoever created it, e.g. the roccl-perf launcher). Validated: exactly 256 hex digits.
    UniqueIdHex(String),
}

/// Rank, size and root found in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvInfo {
    /// This process's rank, below `nranks`.
    pub rank: usize,
    /// Number of ranks in the communicator (at least 1).
    pub nranks: usize,
    /// Where the root listens.
    pub root: Root,
    /// Which launcher convention matched: `"roccl"`, `"torchrun"`, `"ompi"`, `"mpich"` or
    /// `"slurm"`.
    pub launcher: &'static str,
}

/// Length of a unique id in hex characters.
const UNIQUE_ID_HEX_LEN: usize = 256;
/// Base of the port derived from Slurm job and step ids.
const SLURM_PORT_BASE: u16 = 29400;
/// Number of ports the Slurm derivation spreads over.
const SLURM_PORT_SPAN: u64 = 1000;

/// One launcher's rank/size variables.
struct Convention {
    rank: &'static str,
    size: &'static str,
    launcher: &'static str,
    /// How to get the missing variable set, for error messages.
    hint: &'static str,
}

/// Launcher conventions, in precedence order (see the module documentation).
const CONVENTIONS: &[Convention] = &[
    Convention {
        rank: "ROCCL_RANK",
        size: "ROCCL_NRANKS",
        launcher: "roccl",
        hint: "set both ROCCL_RANK and ROCCL_NRANKS",
    },
    Convention {
        rank: "RANK",
        size: "WORLD_SIZE",
        launcher: "torchrun",
        hint: "run under torchrun, or set both RANK and WORLD_SIZE",
    },
    Convention {
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        launcher: "ompi",
        hint: "run under Open MPI's mpirun",
    },
    Convention {
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        launcher: "mpich",
        hint: "run under MPICH's mpiexec",
    },
    Convention {
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        launcher: "slurm",
        hint: "start each task with srun (e.g. srun -n <ranks> ...)",
    },
];

/// Read rank, size and root from the process environment (see the module documentation for
/// the rules). Variables that are not valid Unicode count as unset.
pub fn from_env() -> Result<EnvInfo> {
    from_lookup(&|name| std::env::var(name).ok())
}

/// The job secret of launcher mode from the process environment (see [`job_secret_from`]);
/// `root` is the root's address every rank was given (a pass phrase's salt).
pub fn job_secret(
    root: std::net::SocketAddr,
) -> Result<Option<[u8; crate::bootstrap::SECRET_BYTES]>> {
    job_secret_from(&|name| std::env::var(name).ok(), root)
}

/// Shortest `ROCCL_JOB_SECRET` taken as a pass phrase.
const MIN_SECRET_CHARS: usize = 16;

/// The job secret: `ROCCL_JOB_SECRET`, or the contents of the file `ROCCL_JOB_SECRET_FILE`
/// names (trimmed); 32 hex digits are the secret's 128 bits, any other text of at least 16
/// characters is a pass phrase, stretched with PBKDF2 ([`super::auth::stretch`]) salted by
/// the root's address `root` (so a guess made for one job is worth nothing for another).
/// `None` when neither is set.
pub fn job_secret_from(
    get: &dyn Fn(&str) -> Option<String>,
    root: std::net::SocketAddr,
) -> Result<Option<[u8; crate::bootstrap::SECRET_BYTES]>> {
    let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    let (text, from) = match (var("ROCCL_JOB_SECRET"), var("ROCCL_JOB_SECRET_FILE")) {
        (Some(_), Some(_)) => {
            return Err(Error::arg(
                "both ROCCL_JOB_SECRET and ROCCL_JOB_SECRET_FILE are set: set one",
            ))
        }
        (Some(v), None) => (v, "ROCCL_JOB_SECRET".to_string()),
        (None, Some(f)) => {
            let f = f.trim().to_string();
            let text = std::fs::read_to_string(&f).map_err(|e| {
                Error::arg(format!(
                    "ROCCL_JOB_SECRET_FILE={f}: cannot read the job secret ({e}); every rank needs the same file"
                ))
            })?;
            (text, format!("the file {f} (ROCCL_JOB_SECRET_FILE)"))
        }
        (None, None) => return Ok(None),
    };
    let t = text.trim();
    let mut out = [0u8; crate::bootstrap::SECRET_BYTES];
    if t.len() == 32 && t.bytes().all(|c| c.is_ascii_hexdigit()) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).expect("checked hex");
        }
    } else if t.chars().count() >= MIN_SECRET_CHARS {
        let salt = format!("roccl job secret v2 {root}");
        out = super::auth::stretch(t.as_bytes(), salt.as_bytes());
    } else {
        return Err(Error::arg(format!(
            "the job secret in {from} is {} characters: use at least {MIN_SECRET_CHARS} (e.g. 32 hex digits from `openssl rand -hex 16`)",
            t.chars().count()
        )));
    }
    Ok(Some(out))
}

/// Same as [`from_env`], reading variables through `get` (which returns `None` for unset
/// ones), so that any environment can be tested.
pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<EnvInfo> {
    let var = |name: &str| -> Option<String> {
        get(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let Some(conv) = CONVENTIONS.iter().find(|c| var(c.rank).is_some()) else {
        // A size without its rank usually means a half-set or a half-started launch.
        if let Some(c) = CONVENTIONS.iter().find(|c| var(c.size).is_some()) {
            return Err(Error::arg(format!(
                "{} is set ({}) but {} is not: {}",
                c.size, c.launcher, c.rank, c.hint
            )));
        }
        return Err(Error::arg(
            "no launcher environment found: set ROCCL_RANK, ROCCL_NRANKS and ROCCL_ROOT \
             (or run under torchrun/srun/mpirun)",
        ));
    };
    let rank = parse_count(conv.rank, &var(conv.rank).unwrap_or_default())?;
    let Some(size) = var(conv.size) else {
        return Err(Error::arg(format!(
            "{} is set ({}) but {} is not: {}",
            conv.rank, conv.launcher, conv.size, conv.hint
        )));
    };
    let nranks = parse_count(conv.size, &size)?;
    if nranks == 0 {
        return Err(Error::arg(format!(
            "{}=0: a communicator needs at least one rank",
            conv.size
        )));
    }
    if rank >= nranks {
        return Err(Error::arg(format!(
            "{}={rank} is not below {}={nranks} (ranks are numbered from 0)",
            conv.rank, conv.size
        )));
    }
    let root = find_root(&var, conv, nranks)?;
    Ok(EnvInfo {
        rank,
        nranks,
        root,
        launcher: conv.launcher,
    })
}

/// Parse a rank or size variable.
fn parse_count(name: &str, value: &str) -> Result<usize> {
    value.parse::<usize>().map_err(|_| {
        Error::arg(format!(
            "{name}={value:?} is not a number (expected a non-negative integer)"
        ))
    })
}

/// Parse a port variable: 1 to 65535.
fn parse_port(name: &str, value: &str) -> Result<u16> {
    match value.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(Error::arg(format!(
            "{name}={value:?} is not a port number (expected 1 to 65535)"
        ))),
    }
}

/// Apply the root rules (see the module documentation).
fn find_root(
    var: &dyn Fn(&str) -> Option<String>,
    conv: &Convention,
    nranks: usize,
) -> Result<Root> {
    if let Some(id) = var("ROCCL_UNIQUE_ID") {
        return parse_unique_id(&id);
    }
    if let Some(root) = var("ROCCL_ROOT") {
        let (host, port) = parse_host_port("ROCCL_ROOT", &root)?;
        return Ok(Root::Addr { host, port });
    }
    let root_port = var("ROCCL_ROOT_PORT")
        .map(|p| parse_port("ROCCL_ROOT_PORT", &p))
        .transpose()?;
    if let Some(addr) = var("MASTER_ADDR") {
        let host = strip_brackets(&addr).to_string();
        let port = match root_port {
            Some(p) => p,
            None => {
                let Some(mp) = var("MASTER_PORT") else {
                    return Err(Error::arg(
                        "MASTER_ADDR is set but MASTER_PORT is not: set MASTER_PORT \
                         (roccl's root then uses MASTER_PORT+1) or ROCCL_ROOT_PORT",
                    ));
                };
                let mp = parse_port("MASTER_PORT", &mp)?;
                mp.checked_add(1).ok_or_else(|| {
                    Error::arg(
                        "MASTER_PORT=65535 leaves no port for roccl's root, which uses \
                         MASTER_PORT+1 (torchrun's TCPStore holds MASTER_PORT): \
                         set ROCCL_ROOT_PORT or ROCCL_ROOT=host:port",
                    )
                })?
            }
        };
        return Ok(Root::Addr { host, port });
    }
    if conv.launcher == "slurm" {
        return slurm_root(var, root_port);
    }
    if nranks == 1 {
        return Ok(Root::Addr {
            host: "127.0.0.1".to_string(),
            port: 0,
        });
    }
    let also = if conv.launcher == "roccl" {
        " or ROCCL_UNIQUE_ID"
    } else {
        ""
    };
    Err(Error::arg(format!(
        "found {} ({}) but no root address: set ROCCL_ROOT=host:port \
         (rank 0's host and a free port){also}",
        conv.rank, conv.launcher
    )))
}

/// Root from Slurm's node list and job/step ids.
fn slurm_root(var: &dyn Fn(&str) -> Option<String>, root_port: Option<u16>) -> Result<Root> {
    let nodelist = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .into_iter()
    .find_map(|name| var(name).map(|v| (name, v)));
    let Some((list_var, nodelist)) = nodelist else {
        return Err(Error::arg(
            "found SLURM_PROCID (slurm) but none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, \
             SLURM_NODELIST: set ROCCL_ROOT=host:port (rank 0's host and a free port)",
        ));
    };
    let host = first_host(&nodelist).map_err(|e| Error::arg(format!("{list_var}: {e}")))?;
    let port = match root_port {
        Some(p) => p,
        None => {
            let Some(job) = var("SLURM_JOB_ID") else {
                return Err(Error::arg(
                    "found SLURM_PROCID (slurm) but SLURM_JOB_ID is not set, so no root port \
                     can be derived: set ROCCL_ROOT_PORT=<port> or ROCCL_ROOT=host:port",
                ));
            };
            let job = parse_id("SLURM_JOB_ID", &job)?;
            let step = match var("SLURM_STEP_ID") {
                Some(s) => parse_id("SLURM_STEP_ID", &s)?,
                None => 0,
            };
            // Below SLURM_PORT_SPAN, so the sum stays within u16.
            let offset = (job.wrapping_add(step) % SLURM_PORT_SPAN) as u16;
            SLURM_PORT_BASE + offset
        }
    };
    Ok(Root::Addr { host, port })
}

/// Parse a Slurm job or step id.
fn parse_id(name: &str, value: &str) -> Result<u64> {
    value.parse::<u64>().map_err(|_| {
        Error::arg(format!(
            "{name}={value:?} is not a number; set ROCCL_ROOT_PORT=<port> to avoid deriving \
             the root port from it"
        ))
    })
}

/// Validate a `ROCCL_UNIQUE_ID`.
fn parse_unique_id(id: &str) -> Result<Root> {
    let n = id.chars().count();
    if n != UNIQUE_ID_HEX_LEN {
        return Err(Error::arg(format!(
            "ROCCL_UNIQUE_ID has {n} characters; expected {UNIQUE_ID_HEX_LEN} hex digits \
             (a whole unique id, as printed by its creator)"
        )));
    }
    if let Some((pos, c)) = id.chars().enumerate().find(|(_, c)| !c.is_ascii_hexdigit()) {
        return Err(Error::arg(format!(
            "ROCCL_UNIQUE_ID has a non-hex character {c:?} at position {pos}; expected \
             {UNIQUE_ID_HEX_LEN} hex digits"
        )));
    }
    Ok(Root::UniqueIdHex(id.to_string()))
}

/// `[addr]` → `addr`; anything else unchanged.
fn strip_brackets(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Whether `s` is an IPv6 address, optionally with a `%zone` suffix.
fn is_ipv6_literal(s: &str) -> bool {
    let addr = match s.split_once('%') {
        Some((a, zone)) if !zone.is_empty() => a,
        Some(_) => return false,
        None => s,
    };
    addr.parse::<Ipv6Addr>().is_ok()
}

/// Parse `host:port` or `[ipv6]:port`, read from variable `name`.
fn parse_host_port(name: &str, value: &str) -> Result<(String, u16)> {
    let bad = |why: &str| {
        Error::arg(format!(
            "{name}={value:?} {why}; expected host:port or [ipv6-address]:port"
        ))
    };
    let (host, port) = if let Some(rest) = value.strip_prefix('[') {
        let Some((host, after)) = rest.split_once(']') else {
            return Err(bad("has no closing ']'"));
        };
        if !is_ipv6_literal(host) {
            return Err(bad(&format!(
                "has {host:?} in brackets, not an IPv6 address"
            )));
        }
        let Some(port) = after.strip_prefix(':') else {
            return Err(bad("has no ':port' after the bracketed address"));
        };
        (host, port)
    } else {
        let Some((host, port)) = value.rsplit_once(':') else {
            return Err(bad("has no port"));
        };
        if host.contains(':') {
            return Err(bad("looks like a bare IPv6 address: write it in brackets"));
        }
        (host, port)
    };
    if host.is_empty() {
        return Err(bad("has no host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok((host.to_string(), p)),
        _ => Err(bad(&format!(
            "has port {port:?}, not a number from 1 to 65535"
        ))),
    }
}

/// First host of a Slurm node list.
///
/// A node list is a comma-separated list of host expressions, each of which may hold bracket
/// groups of numbers and ranges; the first host takes each group's first number as written
/// (zero padding kept):
///
/// - `"node[01-04,07],gpu5"` → `"node01"`;
/// - `"a,b"` → `"a"`, `"host"` → `"host"`;
/// - `"rack[1-2]-n[3-4]"` → `"rack1-n3"`.
///
/// Errors ([`Error::InvalidArgument`]): an empty list or entry, unbalanced or nested brackets,
/// an empty group, or a group item that is not `N` or `N-M` with decimal digits.
pub fn slurm_first_host(nodelist: &str) -> Result<String> {
    first_host(nodelist).map_err(Error::arg)
}

/// [`slurm_first_host`] with a plain message as error.
fn first_host(nodelist: &str) -> std::result::Result<String, String> {
    let list = nodelist.trim();
    let bad = |why: &str| format!("Slurm node list {nodelist:?} {why}");
    if list.is_empty() {
        return Err(bad("is empty"));
    }
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(bad("has nested brackets")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(bad("has a ']' without '['")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(bad("has a '[' without ']'"));
    }
    let entry = list[..end].trim();
    if entry.is_empty() {
        return Err(bad("starts with an empty entry"));
    }
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        // Brackets were checked balanced and not nested above.
        let close = after
            .find(']')
            .ok_or_else(|| bad("has a '[' without ']'"))?;
        let group = &after[..close];
        let item = group.split(',').next().unwrap_or_default().trim();
        let (lo, hi) = match item.split_once('-') {
            Some((lo, hi)) => (lo, Some(hi)),
            None => (item, None),
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !hi.map_or(true, digits) {
            return Err(bad(&format!(
                "has [{group}]: expected numbers or ranges like [01-04,07]"
            )));
        }
        host.push_str(lo);
        rest = &after[close + 1..];
    }
    host.push_str(rest);
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> Result<EnvInfo> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_lookup(&move |k| map.get(k).cloned())
    }

    fn addr(host: &str, port: u16) -> Root {
        Root::Addr {
            host: host.to_string(),
            port,
        }
    }

    fn err(vars: &[(&str, &str)]) -> String {
        match lookup(vars) {
            Ok(info) => panic!("expected an error for {vars:?}, got {info:?}"),
            Err(e) => {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                e.to_string()
            }
        }
    }

    fn assert_contains(msg: &str, part: &str) {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }

    fn hex_id() -> String {
        "0123456789abcdefABCDEF".chars().cycle().take(256).collect()
    }

    #[test]
    fn job_secrets() {
        let get = |vars: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                vars.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            }
        };
        let at = |s: &str| -> std::net::SocketAddr { s.parse().unwrap() };
        let root = at("10.0.0.1:29500");
        assert_eq!(job_secret_from(&get(&[]), root).unwrap(), None);
        let hex = job_secret_from(
            &get(&[("ROCCL_JOB_SECRET", " 000102030405060708090a0b0c0d0e0f\n")]),
            root,
        )
        .unwrap()
        .unwrap();
        assert_eq!(hex, core::array::from_fn(|i| i as u8));
        let phrase = |p: &'static str, r| {
            let v: &'static [(&str, &str)] =
                Box::leak(vec![("ROCCL_JOB_SECRET", p)].into_boxed_slice());
            job_secret_from(&get(v), r).unwrap().unwrap()
        };
        let a = phrase("correct horse battery", root);
        assert_ne!(a, phrase("correct horse battery!", root));
        // A pass phrase is stretched, salted by the root: not its SHA-256, and another job's
        // root gives another secret.
        use sha2::Digest;
        assert_ne!(a[..], sha2::Sha256::digest(b"correct horse battery")[..16]);
        assert_ne!(a, phrase("correct horse battery", at("10.0.0.1:29501")));
        assert_eq!(a, phrase("correct horse battery", root));
        let e = job_secret_from(&get(&[("ROCCL_JOB_SECRET", "short")]), root)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 16"), "{e}");
        let e = job_secret_from(
            &get(&[
                ("ROCCL_JOB_SECRET", "correct horse battery"),
                ("ROCCL_JOB_SECRET_FILE", "/x"),
            ]),
            root,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("set one"), "{e}");
        let e = job_secret_from(
            &get(&[("ROCCL_JOB_SECRET_FILE", "/nonexistent/roccl-secret")]),
            root,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("/nonexistent/roccl-secret"), "{e}");
        let f = std::env::temp_dir().join(format!("roccl-secret-{}", std::process::id()));
        std::fs::write(&f, "000102030405060708090a0b0c0d0e0f\n").unwrap();
        let path: &'static str = Box::leak(f.to_string_lossy().to_string().into_boxed_str());
        let vars: &'static [(&str, &str)] =
            Box::leak(vec![("ROCCL_JOB_SECRET_FILE", path)].into_boxed_slice());
        assert_eq!(job_secret_from(&get(vars), root).unwrap(), Some(hex));
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn roccl_launcher() {
        let info = lookup(&[
            ("ROCCL_RANK", "2"),
            ("ROCCL_NRANKS", "4"),
            ("ROCCL_ROOT", "node1:5000"),
        ])
        .unwrap();
        assert_eq!(
            info,
            EnvInfo {
                rank: 2,
                nranks: 4,
                root: addr("node1", 5000),
                launcher: "roccl"
            }
        );
    }

    #[test]
    fn roccl_unique_id_wins() {
        let id = hex_id();
        let info = lookup(&[
            ("ROCCL_RANK", "0"),
            ("ROCCL_NRANKS", "2"),
            ("ROCCL_UNIQUE_ID", &id),
            ("ROCCL_ROOT", "node1:5000"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(info.root, Root::UniqueIdHex(id));
    }

    #[test]
    fn unique_id_validation() {
        let base = [("ROCCL_RANK", "0"), ("ROCCL_NRANKS", "2")];
        let short = "ab".repeat(100);
        let msg = err(&[base[0], base[1], ("ROCCL_UNIQUE_ID", &short)]);
        assert_contains(
            &msg,
            "ROCCL_UNIQUE_ID has 200 characters; expected 256 hex digits",
        );
        let mut bad = hex_id();
        bad.replace_range(10..11, "g");
        let msg = err(&[base[0], base[1], ("ROCCL_UNIQUE_ID", &bad)]);
        assert_contains(&msg, "non-hex character 'g' at position 10");
        // Surrounding blanks are trimmed.
        let padded = format!("  {}\n", hex_id());
        let info = lookup(&[base[0], base[1], ("ROCCL_UNIQUE_ID", &padded)]).unwrap();
        assert_eq!(info.root, Root::UniqueIdHex(hex_id()));
    }

    #[test]
    fn torchrun_launcher_uses_master_port_plus_one() {
        let info = lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            info,
            EnvInfo {
                rank: 3,
                nranks: 8,
                root: addr("10.0.0.1", 29501),
                launcher: "torchrun"
            }
        );
    }

    #[test]
    fn torchrun_root_overrides() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "29500"),
        ];
        let mut vars = base.to_vec();
        vars.push(("ROCCL_ROOT_PORT", "6000"));
        assert_eq!(lookup(&vars).unwrap().root, addr("m", 6000));
        let mut vars = base.to_vec();
        vars.push(("ROCCL_ROOT", "other:7000"));
        assert_eq!(lookup(&vars).unwrap().root, addr("other", 7000));
        // ROCCL_ROOT_PORT makes MASTER_PORT unnecessary.
        let vars = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("ROCCL_ROOT_PORT", "6000"),
        ];
        assert_eq!(lookup(&vars).unwrap().root, addr("m", 6000));
    }

    #[test]
    fn torchrun_errors() {
        let msg = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "65535"),
        ]);
        assert_contains(&msg, "MASTER_PORT=65535");
        assert_contains(&msg, "ROCCL_ROOT_PORT");
        let msg = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "m")]);
        assert_contains(&msg, "MASTER_ADDR is set but MASTER_PORT is not");
        let msg = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "http"),
        ]);
        assert_contains(&msg, "MASTER_PORT=\"http\" is not a port number");
        let msg = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "0"),
        ]);
        assert_contains(&msg, "MASTER_PORT=\"0\" is not a port number");
        let msg = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert_contains(
            &msg,
            "found RANK (torchrun) but no root address: set ROCCL_ROOT",
        );
        let msg = err(&[("RANK", "1"), ("MASTER_ADDR", "m"), ("MASTER_PORT", "1")]);
        assert_contains(&msg, "RANK is set (torchrun) but WORLD_SIZE is not");
        let msg = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("ROCCL_ROOT_PORT", "99999"),
        ]);
        assert_contains(&msg, "ROCCL_ROOT_PORT=\"99999\" is not a port number");
    }

    #[test]
    fn master_addr_ipv6() {
        for a in ["::1", "[::1]"] {
            let info = lookup(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", a),
                ("MASTER_PORT", "29500"),
            ])
            .unwrap();
            assert_eq!(info.root, addr("::1", 29501));
        }
    }

    #[test]
    fn slurm_launcher() {
        let info = lookup(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "2"),
            ("SLURM_STEP_NODELIST", "gpu[003-006]"),
            ("SLURM_JOB_NODELIST", "gpu[001-008]"),
        ])
        .unwrap();
        // 29400 + (123456 + 2) % 1000 = 29858.
        assert_eq!(
            info,
            EnvInfo {
                rank: 5,
                nranks: 16,
                root: addr("gpu003", 29858),
                launcher: "slurm"
            }
        );
    }

    #[test]
    fn slurm_fallbacks_and_overrides() {
        let base = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_ID", "999"),
        ];
        // No step id: 0. Job node list when there is no step node list.
        let mut vars = base.to_vec();
        vars.push(("SLURM_JOB_NODELIST", "a,b"));
        vars.push(("SLURM_NODELIST", "z"));
        assert_eq!(lookup(&vars).unwrap().root, addr("a", 30399));
        let mut vars = base.to_vec();
        vars.push(("SLURM_NODELIST", "z[7-8]"));
        vars.push(("SLURM_STEP_ID", "1"));
        assert_eq!(lookup(&vars).unwrap().root, addr("z7", 29400));
        // The batch step id (0xfffffffe) does not overflow.
        let mut vars = base.to_vec();
        vars.push(("SLURM_NODELIST", "n1"));
        vars.push(("SLURM_STEP_ID", "4294967294"));
        assert_eq!(
            lookup(&vars).unwrap().root,
            addr("n1", 29400 + ((999 + 4294967294u64) % 1000) as u16)
        );
        // ROCCL_ROOT_PORT replaces the derived port and makes SLURM_JOB_ID unnecessary.
        let vars = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "n1"),
            ("ROCCL_ROOT_PORT", "4242"),
        ];
        assert_eq!(lookup(&vars).unwrap().root, addr("n1", 4242));
        // MASTER_ADDR (set by many sbatch scripts) and ROCCL_ROOT come first.
        let mut vars = base.to_vec();
        vars.push(("SLURM_NODELIST", "n1"));
        vars.push(("MASTER_ADDR", "head"));
        vars.push(("MASTER_PORT", "1234"));
        assert_eq!(lookup(&vars).unwrap().root, addr("head", 1235));
        vars.push(("ROCCL_ROOT", "[fe80::1%eth0]:80"));
        assert_eq!(lookup(&vars).unwrap().root, addr("fe80::1%eth0", 80));
    }

    #[test]
    fn slurm_errors() {
        let msg = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_ID", "1"),
        ]);
        assert_contains(
            &msg,
            "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST",
        );
        assert_contains(&msg, "ROCCL_ROOT=host:port");
        let msg = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "n1"),
        ]);
        assert_contains(&msg, "SLURM_JOB_ID is not set");
        assert_contains(&msg, "ROCCL_ROOT_PORT");
        let msg = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "n1"),
            ("SLURM_JOB_ID", "12x"),
        ]);
        assert_contains(&msg, "SLURM_JOB_ID=\"12x\" is not a number");
        let msg = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "n1"),
            ("SLURM_JOB_ID", "12"),
            ("SLURM_STEP_ID", "batch"),
        ]);
        assert_contains(&msg, "SLURM_STEP_ID=\"batch\" is not a number");
        let msg = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "n[1-"),
            ("SLURM_JOB_ID", "12"),
        ]);
        assert_contains(&msg, "SLURM_JOB_NODELIST: Slurm node list \"n[1-\"");
        let msg = err(&[("SLURM_PROCID", "0"), ("SLURM_NODELIST", "n1")]);
        assert_contains(&msg, "SLURM_PROCID is set (slurm) but SLURM_NTASKS is not");
        // Inside an salloc shell: SLURM_NTASKS without SLURM_PROCID.
        let msg = err(&[("SLURM_NTASKS", "4"), ("SLURM_NODELIST", "n1")]);
        assert_contains(&msg, "SLURM_NTASKS is set (slurm) but SLURM_PROCID is not");
        assert_contains(&msg, "srun");
    }

    #[test]
    fn ompi_launcher() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("ROCCL_ROOT", "host0:4000"),
        ];
        let info = lookup(&vars).unwrap();
        assert_eq!(
            info,
            EnvInfo {
                rank: 1,
                nranks: 2,
                root: addr("host0", 4000),
                launcher: "ompi"
            }
        );
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "host0"),
            ("MASTER_PORT", "4000"),
        ];
        assert_eq!(lookup(&vars).unwrap().root, addr("host0", 4001));
        let msg = err(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert_contains(
            &msg,
            "found OMPI_COMM_WORLD_RANK (ompi) but no root address: set ROCCL_ROOT=host:port \
             (rank 0's host and a free port)",
        );
        let msg = err(&[("OMPI_COMM_WORLD_RANK", "1")]);
        assert_contains(
            &msg,
            "OMPI_COMM_WORLD_RANK is set (ompi) but OMPI_COMM_WORLD_SIZE is not",
        );
    }

    #[test]
    fn mpich_launcher() {
        let info = lookup(&[("PMI_RANK", "3"), ("PMI_SIZE", "4"), ("ROCCL_ROOT", "h:1")]).unwrap();
        assert_eq!((info.rank, info.nranks, info.launcher), (3, 4, "mpich"));
        let msg = err(&[("PMI_RANK", "3"), ("PMI_SIZE", "4")]);
        assert_contains(&msg, "found PMI_RANK (mpich) but no root address");
    }

    #[test]
    fn precedence() {
        let all = [
            ("ROCCL_RANK", "1"),
            ("ROCCL_NRANKS", "10"),
            ("RANK", "2"),
            ("WORLD_SIZE", "20"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "30"),
            ("PMI_RANK", "4"),
            ("PMI_SIZE", "40"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "50"),
            ("SLURM_NODELIST", "n1"),
            ("SLURM_JOB_ID", "1"),
            ("ROCCL_ROOT", "h:1"),
        ];
        let expect = [
            (1, 10, "roccl"),
            (2, 20, "torchrun"),
            (3, 30, "ompi"),
            (4, 40, "mpich"),
            (5, 50, "slurm"),
        ];
        for (skip, want) in expect.iter().enumerate() {
            let vars: Vec<_> = all[skip * 2..].to_vec();
            let info = lookup(&vars).unwrap();
            assert_eq!((info.rank, info.nranks, info.launcher), *want);
        }
        // mpirun inside an sbatch allocation: the MPI variables win over SLURM_PROCID.
        let info = lookup(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_NODELIST", "n1"),
            ("SLURM_JOB_ID", "1"),
            ("OMPI_COMM_WORLD_RANK", "6"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("ROCCL_ROOT", "n1:5000"),
        ])
        .unwrap();
        assert_eq!((info.rank, info.nranks, info.launcher), (6, 8, "ompi"));
        // Empty values count as unset.
        let info = lookup(&[
            ("ROCCL_RANK", ""),
            ("ROCCL_NRANKS", " "),
            ("RANK", " 1 "),
            ("WORLD_SIZE", "2"),
            ("ROCCL_ROOT", "h:9"),
            ("ROCCL_UNIQUE_ID", ""),
        ])
        .unwrap();
        assert_eq!(
            (info.rank, info.launcher, info.root),
            (1, "torchrun", addr("h", 9))
        );
    }

    #[test]
    fn rank_and_size_errors() {
        let msg = err(&[
            ("ROCCL_RANK", "5"),
            ("ROCCL_NRANKS", "4"),
            ("ROCCL_ROOT", "h:1"),
        ]);
        assert_contains(&msg, "ROCCL_RANK=5 is not below ROCCL_NRANKS=4");
        let msg = err(&[
            ("ROCCL_RANK", "4"),
            ("ROCCL_NRANKS", "4"),
            ("ROCCL_ROOT", "h:1"),
        ]);
        assert_contains(&msg, "ROCCL_RANK=4 is not below ROCCL_NRANKS=4");
        let msg = err(&[
            ("ROCCL_RANK", "0"),
            ("ROCCL_NRANKS", "0"),
            ("ROCCL_ROOT", "h:1"),
        ]);
        assert_contains(
            &msg,
            "ROCCL_NRANKS=0: a communicator needs at least one rank",
        );
        let msg = err(&[("ROCCL_RANK", "one"), ("ROCCL_NRANKS", "4")]);
        assert_contains(&msg, "ROCCL_RANK=\"one\" is not a number");
        let msg = err(&[("ROCCL_RANK", "-1"), ("ROCCL_NRANKS", "4")]);
        assert_contains(&msg, "ROCCL_RANK=\"-1\" is not a number");
        let msg = err(&[("ROCCL_RANK", "1"), ("ROCCL_NRANKS", "4x")]);
        assert_contains(&msg, "ROCCL_NRANKS=\"4x\" is not a number");
        let msg = err(&[("ROCCL_RANK", "1"), ("ROCCL_ROOT", "h:1")]);
        assert_contains(&msg, "ROCCL_RANK is set (roccl) but ROCCL_NRANKS is not");
        let msg = err(&[("ROCCL_NRANKS", "2")]);
        assert_contains(&msg, "ROCCL_NRANKS is set (roccl) but ROCCL_RANK is not");
        let msg = err(&[("WORLD_SIZE", "2")]);
        assert_contains(&msg, "WORLD_SIZE is set (torchrun) but RANK is not");
        let msg = err(&[("ROCCL_RANK", "1"), ("ROCCL_NRANKS", "4")]);
        assert_contains(
            &msg,
            "found ROCCL_RANK (roccl) but no root address: set ROCCL_ROOT=host:port",
        );
        assert_contains(&msg, "ROCCL_UNIQUE_ID");
    }

    #[test]
    fn no_launcher() {
        let msg = err(&[("HOME", "/root")]);
        assert_contains(
            &msg,
            "no launcher environment found: set ROCCL_RANK, ROCCL_NRANKS and ROCCL_ROOT \
             (or run under torchrun/srun/mpirun)",
        );
    }

    #[test]
    fn single_rank_needs_no_root() {
        let info = lookup(&[("ROCCL_RANK", "0"), ("ROCCL_NRANKS", "1")]).unwrap();
        assert_eq!(info.root, addr("127.0.0.1", 0));
    }

    #[test]
    fn root_addresses() {
        let base = [("ROCCL_RANK", "0"), ("ROCCL_NRANKS", "2")];
        let root = |r: &str| lookup(&[base[0], base[1], ("ROCCL_ROOT", r)]);
        assert_eq!(root("[::1]:5000").unwrap().root, addr("::1", 5000));
        assert_eq!(
            root("[2001:db8::7]:29400").unwrap().root,
            addr("2001:db8::7", 29400)
        );
        assert_eq!(root("10.1.2.3:1").unwrap().root, addr("10.1.2.3", 1));
        assert_eq!(
            root(" h.example.com:65535 ").unwrap().root,
            addr("h.example.com", 65535)
        );
        let e = |r: &str| root(r).unwrap_err().to_string();
        assert_contains(&e("::1:5000"), "bare IPv6 address: write it in brackets");
        assert_contains(&e("host"), "ROCCL_ROOT=\"host\" has no port");
        assert_contains(&e("host"), "expected host:port or [ipv6-address]:port");
        assert_contains(&e(":5000"), "has no host");
        assert_contains(&e("h:0"), "not a number from 1 to 65535");
        assert_contains(&e("h:70000"), "not a number from 1 to 65535");
        assert_contains(&e("h:"), "not a number from 1 to 65535");
        assert_contains(&e("[::1:5000"), "no closing ']'");
        assert_contains(&e("[::1]5000"), "no ':port'");
        assert_contains(&e("[host]:5000"), "not an IPv6 address");
        assert_contains(&e("[::1%]:5000"), "not an IPv6 address");
    }

    #[test]
    fn slurm_nodelists() {
        let ok = |s: &str| slurm_first_host(s).unwrap();
        assert_eq!(ok("node[01-04,07],gpu5"), "node01");
        assert_eq!(ok("a,b"), "a");
        assert_eq!(ok("host"), "host");
        assert_eq!(ok(" host \n"), "host");
        assert_eq!(ok("rack[1-2]-n[3-4]"), "rack1-n3");
        assert_eq!(ok("gpu[007]"), "gpu007");
        assert_eq!(ok("gpu[0010-0020]"), "gpu0010");
        assert_eq!(ok("n[5,1-3]"), "n5");
        assert_eq!(ok("gpu5,node[01-04]"), "gpu5");
        assert_eq!(ok("[1-2]x"), "1x");
        assert_eq!(ok("node-a.cluster,node-b"), "node-a.cluster");
        for bad in [
            "", "  ", ",a", "n[1-2", "n1-2]", "n[[1]]", "n[]", "n[a-b]", "n[1-]", "n[-2]",
            "n[1-2x]",
        ] {
            let e = slurm_first_host(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e:?}");
            assert!(e.to_string().contains("Slurm node list"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn process_environment_reads() {
        // Only checks that from_env consults the real environment without panicking; its
        // outcome depends on how the tests were launched.
        let _ = from_env();
    }
}
