//! Communicator settings: [`Config`], read from the `ROCCL_*` environment or built by hand.

use crate::algo::model::Tuning;
use crate::algo::Algo;
use crate::error::{Error, Result};
use crate::net::sim::SimSpec;
use crate::net::NetKind;
use crate::os::wait::Waiter;

use super::settings;

/// Communicator settings, normally read from `ROCCL_*` environment variables.
#[derive(Clone, Debug)]
pub struct Config {
    /// Network (`ROCCL_NET`: auto, tcp).
    pub net: NetKind,
    /// Forced algorithm (`ROCCL_ALGO`: ring, tree, direct; unset or auto = cost model).
    pub algo: Option<Algo>,
    /// Pipeline overrides (`ROCCL_SLICE` bytes, `ROCCL_DEPTH`, `ROCCL_NCHANNELS`).
    pub tuning: Tuning,
    /// Waiting policy and timeout (`ROCCL_SPIN_US`, `ROCCL_YIELD_US`, `ROCCL_TIMEOUT`).
    pub waiter: Waiter,
    /// Bytes per slot of the shared-memory collectives (`ROCCL_SHM_SLOT`, a multiple of 4096;
    /// `None` = 256 KiB); every rank of a host must use the same.
    pub shm_slot: Option<usize>,
    /// Open the connections calls use with the default pipeline, to and from every peer,
    /// during init (`ROCCL_CONNECT=all`; see [`Communicator::connect_all`](super::Communicator::connect_all)); by default
    /// connections open when first used.
    pub connect_all: bool,
    /// When GPU memory moves without staging where the network can (`ROCCL_GPU_DIRECT`):
    /// the network registers device buffers (dmabuf or peer memory) and sends and receives
    /// them directly; collectives that reduce still stage. Small messages keep going eagerly
    /// (the GPU copies them into and out of the network's bounce buffers).
    pub gpu_direct: GpuDirect,
    /// Smallest message that moves GPU-direct (`ROCCL_GPU_DIRECT_MIN` bytes, `K`/`M`
    /// suffixes; default 64 KiB): below, staging's copies on the stream cost less than the
    /// synchronous GPU copies of eager messages and the registration lookups.
    pub gpu_direct_min: usize,
    /// Ring all-reduces larger than twice this run as consecutive rings over windows of
    /// this many bytes (`ROCCL_RING_WINDOW`, `K`/`M`; default [`RING_WINDOW`]; 0: one ring):
    /// a window's output is still in the cache when the all-gather half sends it. Every
    /// rank must use the same value.
    pub ring_window: usize,
    /// The simulated cluster of `ROCCL_NET=sim` (`ROCCL_SIM`; every rank of a job must
    /// give the same).
    pub sim: SimSpec,
    /// This rank's host, as the topology sees it (`ROCCL_HOSTID`, like `NCCL_HOSTID`): ranks
    /// that give the same name are on one host (shared memory between them, ring orders
    /// and hierarchical collectives grouped by it). `None`: the hostname and kernel boot id.
    /// Naming ranks of one machine apart makes them behave as hosts of a cluster (tests,
    /// trying a hierarchy); naming containers of one machine alike joins them.
    pub host: Option<String>,
    /// Whether calls may run hierarchically on jobs of several hosts with several ranks on
    /// some (`ROCCL_HIER`: auto = when the cost model says so, 0 = never, 1 = whenever the
    /// collective has it). Every rank must use the same value.
    pub hier: Hier,
    /// Settings of the networks and RDMA providers (`ROCCL_TCP_*`, `ROCCL_SHM_RING`,
    /// `ROCCL_SHM_CMA`, `ROCCL_ROCEV2_*`, `ROCCL_IB_*`).
    pub network: crate::net::NetSettings,
}

/// When calls run hierarchically ([`Config::hier`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hier {
    /// Never: flat algorithms over the host-ordered ring.
    Off,
    /// Where the cost model estimates it faster. The default.
    Auto,
    /// Always where the collective has a hierarchical version and the job spans hosts.
    On,
}

fn env_parse<T: std::str::FromStr>(k: &str) -> Result<Option<T>> {
    crate::envvar::get(k)
}

impl Config {
    /// Settings from the environment. Every `ROCCL_*` setting set is checked first, also
    /// those read later inside a network ([`crate::envvar`]): a bad value is an error naming
    /// the variable, its value and what it accepts.
    pub fn from_env() -> Result<Config> {
        settings::check()?;
        let algo = match std::env::var("ROCCL_ALGO") {
            Ok(v) if !v.trim().is_empty() && !v.eq_ignore_ascii_case("auto") => Some(v.parse()?),
            _ => None,
        };
        Ok(Config {
            net: env_parse("ROCCL_NET")?.unwrap_or(NetKind::Auto),
            algo,
            tuning: Tuning {
                slice: match std::env::var("ROCCL_SLICE") {
                    Ok(v) if !v.trim().is_empty() => {
                        Some(crate::envvar::parse_bytes(&v).ok_or_else(|| {
                            Error::arg(format!(
                                "ROCCL_SLICE={v}: expected bytes such as 256K or 1M"
                            ))
                        })?)
                    }
                    _ => None,
                },
                depth: env_parse("ROCCL_DEPTH")?,
                channels: env_parse("ROCCL_NCHANNELS")?,
                // Known after the rendezvous (init).
                nics: 1,
            },
            waiter: Waiter::from_lookup(&crate::envvar::from_process)?,
            shm_slot: match std::env::var_os("ROCCL_SHM_SLOT") {
                Some(_) => Some(crate::algo::shm::node::slot_size()?),
                None => None,
            },
            connect_all: match std::env::var("ROCCL_CONNECT") {
                Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                    "all" | "init" => true,
                    "" | "lazy" | "first-use" => false,
                    other => {
                        return Err(Error::arg(format!(
                            "ROCCL_CONNECT={other}: expected all (connect every peer during init) or lazy (when first used)"
                        )))
                    }
                },
                Err(_) => false,
            },
            gpu_direct: match std::env::var("ROCCL_GPU_DIRECT") {
                Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                    "1" | "on" | "true" | "yes" => GpuDirect::On,
                    "" | "auto" => GpuDirect::Auto,
                    "0" | "off" | "false" | "no" => GpuDirect::Off,
                    other => {
                        return Err(Error::arg(format!(
                            "ROCCL_GPU_DIRECT={other}: expected auto (discrete GPUs, where the network takes GPU memory), 1 (integrated GPUs too) or 0 (always stage)"
                        )))
                    }
                },
                Err(_) => GpuDirect::Auto,
            },
            gpu_direct_min: match std::env::var("ROCCL_GPU_DIRECT_MIN") {
                Ok(v) => crate::envvar::parse_bytes(&v).ok_or_else(|| {
                    Error::arg(format!(
                        "ROCCL_GPU_DIRECT_MIN={v}: expected bytes such as 64K, 1M or 0"
                    ))
                })?,
                Err(_) => GPU_DIRECT_MIN,
            },
            ring_window: match std::env::var("ROCCL_RING_WINDOW") {
                Ok(v) => crate::envvar::parse_bytes(&v).ok_or_else(|| {
                    Error::arg(format!(
                        "ROCCL_RING_WINDOW={v}: expected bytes such as 4M, 2M or 0 (one ring)"
                    ))
                })?,
                Err(_) => RING_WINDOW,
            },
            host: std::env::var("ROCCL_HOSTID")
                .ok()
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty()),
            hier: match std::env::var("ROCCL_HIER") {
                Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                    "" | "auto" => Hier::Auto,
                    "1" | "on" | "true" | "yes" => Hier::On,
                    "0" | "off" | "false" | "no" => Hier::Off,
                    other => {
                        return Err(Error::arg(format!(
                            "ROCCL_HIER={other}: expected auto (the cost model decides), 1 (always) or 0 (never)"
                        )))
                    }
                },
                Err(_) => Hier::Auto,
            },
            sim: env_parse("ROCCL_SIM")?.unwrap_or_default(),
            network: crate::net::NetSettings::from_env()?,
        })
    }
}

/// When stream-ordered calls move GPU memory the CPU cannot reach without staging it
/// ([`Config::gpu_direct`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuDirect {
    /// Always stage.
    Off,
    /// Discrete GPUs, where every peer is reached over a network that takes GPU memory (an
    /// RDMA NIC with dmabuf or peer-memory support). The default.
    Auto,
    /// Integrated GPUs too.
    On,
}

/// Default of [`Config::ring_window`]. 2 ranks on 2 cores sharing a 32 MiB L3, f32 sum,
/// alternated in one fast phase: shared memory 16 MiB 2.33 → 1.92 ms, 64 MiB 10.4 → 9.0 ms;
/// TCP 16 MiB 5.52 → 4.68 ms, 64 MiB 22.6 → 18.9 ms; 2 MiB as good, 8 MiB (the working set of
/// both ranks, 4 windows, fills the cache) worse (docs/PERFORMANCE-LOG.md). Fixed rather than
/// derived from the cache size so that every rank splits alike.
pub const RING_WINDOW: usize = 4 << 20;

/// Default of [`Config::gpu_direct_min`]: on the simulated device over the userspace RoCE
/// engine, GPU-direct broadcasts overtake staged ones between 32 KiB and 512 KiB.
pub const GPU_DIRECT_MIN: usize = 64 << 10;
