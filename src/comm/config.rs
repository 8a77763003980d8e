//! Communicator settings: [`Config`], read from the `ROCCL_*` environment or built by hand.

use crate::algo::model::Tuning;
use crate::algo::Algo;
use crate::envvar::{self, Lookup};
use crate::error::{Error, Result};
use crate::net::sim::SimSpec;
use crate::net::NetKind;
use crate::os::wait::Waiter;

use std::time::Duration;

use super::settings;

/// Communicator settings, normally read from `ROCCL_*` environment variables
/// ([`Config::from_env`]); in code, start from [`Config::default`] and set fields.
#[derive(Clone, Debug)]
#[non_exhaustive]
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
    /// Shared memory between the ranks of a host (`ROCCL_SHM`, default on; 0: every
    /// connection over the network).
    pub shm: bool,
    /// A call waiting this long without progress says so once, naming the peers it waits for
    /// (`ROCCL_STUCK_WARN` seconds; `None`: a third of the timeout).
    pub stuck_warn: Option<Duration>,
    /// Measure this host's reduce and copy speeds for the cost model at first init
    /// (`ROCCL_CALIBRATE`, default on; off: reference speeds). Once per process.
    pub calibrate: bool,
    /// Write a trace of every call (`ROCCL_TRACE`: a path, `%r` for the rank; without it the
    /// rank is appended).
    pub trace: Option<String>,
    /// Serve `/metrics` and `/status` over HTTP at this address (`ROCCL_METRICS_ADDR`:
    /// `host:port`, a bare port for this host only); one endpoint per process, started by the
    /// first communicator that asks.
    pub metrics_addr: Option<String>,
    /// Reductions that return the same bits every time (`ROCCL_DETERMINISTIC=1`): every
    /// reducing collective sums each element in rank order, whatever algorithm, network,
    /// pipeline or channel count would otherwise run it (it runs only the algorithms that
    /// reduce so: one-shot, two-shot, the direct reduce-scatter and reduce, and their
    /// shared-memory forms), so a given rank count and data type give bitwise one result.
    /// Every rank must use the same value. See docs/DETERMINISM.md for what it costs.
    pub deterministic: bool,
    /// On a job of several hosts, measure the links between them at init (`ROCCL_MEASURE`,
    /// default on): a few round trips and one burst between one rank of each pair of hosts,
    /// shared with every rank, and the cost model takes the measured latency and bandwidth
    /// instead of what the NICs advertise ([`Communicator::measured_links`]). Every rank
    /// must use the same value.
    ///
    /// [`Communicator::measured_links`]: super::Communicator::measured_links
    pub measure_links: bool,
    /// Networks offered between hosts besides [`Config::net`] (`ROCCL_NETS=tcp,rocev2`: the
    /// first is [`Config::net`], the others land here): each pair of ranks that both offer
    /// one may use it, per call size, as the links measured at init
    /// ([`Config::measure_links`]) say is fastest. Ranks may offer different ones (a pair
    /// uses what both offer); point-to-point calls stay on [`Config::net`].
    pub extra_nets: Vec<NetKind>,
    /// Whether the thread that creates the communicator is bound to one CPU
    /// (`ROCCL_CPU_BIND`; see [`CpuBind`]). The first communicator a thread creates decides;
    /// later ones (torch's subgroups) leave the thread where it is.
    pub cpu_bind: CpuBind,
}

/// Binding the calling thread to one CPU at init ([`Config::cpu_bind`]).
///
/// With more ranks on a host than cores, every collective waits for the ranks that share a
/// core with another, and the scheduler moving them between cores costs more: at 4 ranks on
/// 2 cores, Hugging Face tensor-parallel decode went from 0.81 to 0.87 of the no-op bound
/// over shared memory and from 0.79 to 0.87 over TCP (docs/PERFORMANCE.md). The thread's
/// CPU is the one at the rank's place among the host's ranks, spread over the CPUs the
/// thread may use (so ranks 0 and 1 of 4 share the first of 2); threads it starts later
/// (torch's worker, roccl's own) inherit it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBind {
    /// Never.
    Off,
    /// When this host has more ranks than cores, each a process of its own, and the thread
    /// may run on more than one CPU (a launcher that already bound it is left alone). The
    /// default.
    Auto,
    /// Whenever the thread may run on more than one CPU.
    On,
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

/// `name` as one of `words`' spellings (`(spellings, value)`), `default` when unset; an
/// error naming what it accepts (`expected`) otherwise.
fn choice<T: Copy>(
    get: Lookup<'_>,
    name: &str,
    default: T,
    words: &[(&[&str], T)],
    expected: &str,
) -> Result<T> {
    let Some(v) = get(name) else {
        return Ok(default);
    };
    let t = v.trim().to_ascii_lowercase();
    if t.is_empty() {
        return Ok(default);
    }
    words
        .iter()
        .find(|(spellings, _)| spellings.contains(&t.as_str()))
        .map(|&(_, value)| value)
        .ok_or_else(|| Error::arg(format!("{name}={t}: expected {expected}")))
}

/// Bytes (`K`/`M`/`G` suffixes) or `default` when unset; `expected` says what it takes.
fn bytes_or(get: Lookup<'_>, name: &str, default: usize, expected: &str) -> Result<usize> {
    match get(name) {
        None => Ok(default),
        Some(v) => crate::envvar::parse_bytes(&v)
            .ok_or_else(|| Error::arg(format!("{name}={v}: expected {expected}"))),
    }
}

const ON: &[&str] = &["1", "on", "true", "yes"];
const OFF: &[&str] = &["0", "off", "false", "no"];

impl Default for Config {
    /// Every setting at its default (no `ROCCL_*` variable read).
    fn default() -> Config {
        Config::from_lookup(&envvar::unset).expect("the defaults parse")
    }
}

impl Config {
    /// Settings from the environment: [`Config::from_lookup`] over the process's variables.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(&envvar::from_process)
    }

    /// Settings from `get` (a variable's name to its value). Every `ROCCL_*` setting set is
    /// checked first, also those only a network or the launcher reads ([`crate::envvar`]): a
    /// bad value is an error naming the variable, its value and what it accepts.
    pub fn from_lookup(get: Lookup<'_>) -> Result<Config> {
        settings::check_with(get)?;
        let algo = match envvar::raw_in(get, "ROCCL_ALGO") {
            Some(v) if !v.eq_ignore_ascii_case("auto") => Some(v.parse()?),
            _ => None,
        };
        let (net, extra_nets) = networks(get)?;
        Ok(Config {
            net,
            algo,
            tuning: Tuning {
                slice: match envvar::raw_in(get, "ROCCL_SLICE") {
                    Some(v) => Some(envvar::parse_bytes(&v).ok_or_else(|| {
                        Error::arg(format!("ROCCL_SLICE={v}: expected bytes such as 256K or 1M"))
                    })?),
                    None => None,
                },
                depth: envvar::get_in(get, "ROCCL_DEPTH")?,
                channels: envvar::get_in(get, "ROCCL_NCHANNELS")?,
                // Known after the rendezvous (init).
                nics: 1,
            },
            waiter: Waiter::from_lookup(get)?,
            shm_slot: match get("ROCCL_SHM_SLOT") {
                Some(v) => Some(crate::algo::shm::node::parse_slot(&v)?),
                None => None,
            },
            shm: envvar::switch_in(get, "ROCCL_SHM", true)?,
            connect_all: choice(
                get,
                "ROCCL_CONNECT",
                false,
                &[(&["all", "init"], true), (&["lazy", "first-use"], false)],
                "all (connect every peer during init) or lazy (when first used)",
            )?,
            gpu_direct: choice(
                get,
                "ROCCL_GPU_DIRECT",
                GpuDirect::Auto,
                &[(ON, GpuDirect::On), (&["auto"], GpuDirect::Auto), (OFF, GpuDirect::Off)],
                "auto (discrete GPUs, where the network takes GPU memory), 1 (integrated GPUs too) or 0 (always stage)",
            )?,
            gpu_direct_min: bytes_or(
                get,
                "ROCCL_GPU_DIRECT_MIN",
                GPU_DIRECT_MIN,
                "bytes such as 64K, 1M or 0",
            )?,
            ring_window: bytes_or(
                get,
                "ROCCL_RING_WINDOW",
                RING_WINDOW,
                "bytes such as 4M, 2M or 0 (one ring)",
            )?,
            host: envvar::raw_in(get, "ROCCL_HOSTID"),
            hier: choice(
                get,
                "ROCCL_HIER",
                Hier::Auto,
                &[(&["auto"], Hier::Auto), (ON, Hier::On), (OFF, Hier::Off)],
                "auto (the cost model decides), 1 (always) or 0 (never)",
            )?,
            sim: envvar::get_in(get, "ROCCL_SIM")?.unwrap_or_default(),
            network: crate::net::NetSettings::from_lookup(get)?,
            stuck_warn: match envvar::value_in::<f64>(get, "ROCCL_STUCK_WARN", 0.0)? {
                s if s > 0.0 && s < 1e9 => Some(Duration::from_secs_f64(s)),
                _ => None,
            },
            calibrate: envvar::switch_in(get, "ROCCL_CALIBRATE", true)?,
            trace: envvar::raw_in(get, "ROCCL_TRACE"),
            metrics_addr: envvar::raw_in(get, "ROCCL_METRICS_ADDR"),
            deterministic: envvar::switch_in(get, "ROCCL_DETERMINISTIC", false)?,
            measure_links: envvar::switch_in(get, "ROCCL_MEASURE", true)?,
            extra_nets,
            cpu_bind: choice(
                get,
                "ROCCL_CPU_BIND",
                CpuBind::Auto,
                &[(&["auto"], CpuBind::Auto), (ON, CpuBind::On), (OFF, CpuBind::Off)],
                "auto (when this host has more ranks than cores), 1 (always) or 0 (never)",
            )?,
        })
    }
}

/// The networks the extra lanes may use ([`Config::extra_nets`]).
pub(crate) const EXTRA_NETS: [NetKind; 3] = NetKind::BETWEEN_HOSTS;

/// `ROCCL_NET` and `ROCCL_NETS`: the main network, and those offered beside it.
fn networks(get: Lookup<'_>) -> Result<(NetKind, Vec<NetKind>)> {
    let net: Option<NetKind> = envvar::get_in(get, "ROCCL_NET")?;
    let Some(list) = envvar::raw_in(get, "ROCCL_NETS").filter(|v| !v.trim().is_empty()) else {
        return Ok((net.unwrap_or(NetKind::Auto), Vec::new()));
    };
    let kinds = list
        .split(',')
        .map(|k| k.trim().parse::<NetKind>())
        .collect::<Result<Vec<_>>>()?;
    let bad = |why: String| Error::arg(format!("ROCCL_NETS={list}: {why}"));
    for (i, k) in kinds.iter().enumerate() {
        if !EXTRA_NETS.contains(k) {
            return Err(bad(format!(
                "{} cannot be chosen between hosts: list tcp, rocev2 or verbs (ranks of one host use shared memory whatever the list)",
                k.name()
            )));
        }
        if kinds[..i].contains(k) {
            return Err(bad(format!("{} is listed twice", k.name())));
        }
    }
    match net {
        Some(n) if n != NetKind::Auto && n != kinds[0] => Err(bad(format!(
            "ROCCL_NET={} forces one network, but ROCCL_NETS starts with {}: unset ROCCL_NET to let roccl choose among ROCCL_NETS (the first is the main network), or unset ROCCL_NETS",
            n.name(),
            kinds[0].name()
        ))),
        _ => Ok((kinds[0], kinds[1..].to_vec())),
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

/// Builds a [`Config`] in code, from the defaults ([`Config::builder`]):
///
/// ```
/// use roccl::{net::NetKind, Config};
/// use std::time::Duration;
/// let cfg = Config::builder()
///     .net(NetKind::Tcp)
///     .timeout(Duration::from_secs(30))
///     .host("node-a")
///     .build();
/// assert_eq!(cfg.net, NetKind::Tcp);
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct ConfigBuilder(Config);

impl Config {
    /// A builder starting from the defaults (no environment read).
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder(Config::default())
    }
}

impl ConfigBuilder {
    /// A builder starting from `cfg` (e.g. [`Config::from_env`]'s).
    pub fn from_config(cfg: Config) -> ConfigBuilder {
        ConfigBuilder(cfg)
    }
    /// [`Config::net`].
    pub fn net(mut self, net: NetKind) -> Self {
        self.0.net = net;
        self
    }
    /// [`Config::algo`].
    pub fn algo(mut self, algo: Algo) -> Self {
        self.0.algo = Some(algo);
        self
    }
    /// [`Config::tuning`].
    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.0.tuning = tuning;
        self
    }
    /// [`Config::waiter`].
    pub fn waiter(mut self, waiter: Waiter) -> Self {
        self.0.waiter = waiter;
        self
    }
    /// How long a wait may go without progress before it fails ([`Waiter::timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.0.waiter.timeout = timeout;
        self
    }
    /// [`Config::host`].
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.0.host = Some(host.into());
        self
    }
    /// [`Config::connect_all`].
    pub fn connect_all(mut self, all: bool) -> Self {
        self.0.connect_all = all;
        self
    }
    /// [`Config::gpu_direct`].
    pub fn gpu_direct(mut self, mode: GpuDirect) -> Self {
        self.0.gpu_direct = mode;
        self
    }
    /// [`Config::hier`].
    pub fn hier(mut self, hier: Hier) -> Self {
        self.0.hier = hier;
        self
    }
    /// [`Config::shm`].
    pub fn shm(mut self, on: bool) -> Self {
        self.0.shm = on;
        self
    }
    /// [`Config::network`].
    pub fn network(mut self, network: crate::net::NetSettings) -> Self {
        self.0.network = network;
        self
    }
    /// [`Config::trace`].
    pub fn trace(mut self, pattern: impl Into<String>) -> Self {
        self.0.trace = Some(pattern.into());
        self
    }
    /// [`Config::metrics_addr`].
    pub fn metrics_addr(mut self, addr: impl Into<String>) -> Self {
        self.0.metrics_addr = Some(addr.into());
        self
    }
    /// [`Config::measure_links`].
    pub fn measure_links(mut self, on: bool) -> Self {
        self.0.measure_links = on;
        self
    }
    /// [`Config::cpu_bind`].
    pub fn cpu_bind(mut self, bind: CpuBind) -> Self {
        self.0.cpu_bind = bind;
        self
    }

    /// [`Config::extra_nets`].
    pub fn extra_nets(mut self, nets: Vec<NetKind>) -> Self {
        self.0.extra_nets = nets;
        self
    }

    /// [`Config::deterministic`].
    pub fn deterministic(mut self, on: bool) -> Self {
        self.0.deterministic = on;
        self
    }
    /// The settings.
    pub fn build(self) -> Config {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ROCCL_NETS` names the main network first and the others beside it; `ROCCL_NET` may
    /// only agree with it; a network that cannot run between hosts, or one listed twice, is
    /// refused naming it.
    #[test]
    fn the_networks_offered_come_from_roccl_nets() {
        let with = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Config::from_lookup(&move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let c = with(&[("ROCCL_NETS", "tcp, rocev2")]).unwrap();
        assert_eq!((c.net, c.extra_nets), (NetKind::Tcp, vec![NetKind::RoceV2]));
        let c = with(&[("ROCCL_NETS", "rocev2"), ("ROCCL_NET", "rocev2")]).unwrap();
        assert_eq!((c.net, c.extra_nets), (NetKind::RoceV2, vec![]));
        let c = with(&[("ROCCL_NET", "tcp")]).unwrap();
        assert!(c.extra_nets.is_empty());
        for (vars, want) in [
            (
                &[("ROCCL_NETS", "tcp,rocev2"), ("ROCCL_NET", "rocev2")][..],
                "forces one network",
            ),
            (&[("ROCCL_NETS", "tcp,tcp")][..], "listed twice"),
            (&[("ROCCL_NETS", "tcp,shm")][..], "ROCCL_NETS"),
            (&[("ROCCL_NETS", "tcp,carrier-pigeon")][..], "ROCCL_NETS"),
        ] {
            let e = with(vars).expect_err(want).to_string();
            assert!(e.contains(want), "{vars:?}: {e}");
        }
    }

    #[test]
    fn settings_come_from_the_lookup_given_and_defaults_from_none() {
        let d = Config::default();
        assert_eq!(
            (d.net, d.shm, d.calibrate, d.hier),
            (NetKind::Auto, true, true, Hier::Auto)
        );
        assert_eq!(
            (d.gpu_direct_min, d.ring_window),
            (GPU_DIRECT_MIN, RING_WINDOW)
        );
        let vars = [
            ("ROCCL_NET", "tcp"),
            ("ROCCL_SHM", "0"),
            ("ROCCL_HIER", "1"),
            ("ROCCL_CONNECT", "all"),
            ("ROCCL_STUCK_WARN", "0.5"),
            ("ROCCL_TRACE", "/tmp/t.%r"),
            ("ROCCL_TCP_DUPLEX", "0"),
            ("ROCCL_TIMEOUT", "7"),
        ];
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let c = Config::from_lookup(&get).unwrap();
        assert_eq!(
            (c.net, c.shm, c.hier, c.connect_all),
            (NetKind::Tcp, false, Hier::On, true)
        );
        assert_eq!(c.stuck_warn, Some(Duration::from_millis(500)));
        assert_eq!(c.trace.as_deref(), Some("/tmp/t.%r"));
        assert_eq!(c.waiter.timeout, Duration::from_secs(7));
        assert!(!c.network.tcp.duplex);
    }

    #[test]
    fn a_bad_value_is_an_error_naming_the_variable() {
        for (k, v) in [
            ("ROCCL_HIER", "sometimes"),
            ("ROCCL_SHM", "maybe"),
            ("ROCCL_SHM_RING", "3"),
        ] {
            let get = move |n: &str| (n == k).then(|| v.to_string());
            let e = Config::from_lookup(&get).unwrap_err();
            assert!(
                matches!(&e, Error::Setting { name, value, .. } if name == k && value == v),
                "{e:?}"
            );
            assert!(e.to_string().contains(k), "{e}");
        }
    }

    #[test]
    fn the_builder_sets_what_it_is_told() {
        let c = Config::builder()
            .net(NetKind::Shm)
            .timeout(Duration::from_secs(3))
            .host("a")
            .shm(false)
            .build();
        assert_eq!(
            (c.net, c.waiter.timeout, c.host.as_deref(), c.shm),
            (NetKind::Shm, Duration::from_secs(3), Some("a"), false)
        );
    }
}
