//! The communicator: a group of ranks that run collectives together.
//!
//! Calls on one communicator run in the order they were issued, whether blocking (on the
//! calling thread) or non-blocking (on the communicator's worker thread): each call takes a
//! ticket when issued and runs when its turn comes. After an error the communicator is
//! unusable (its connections are closed) and every later call says why.

mod agree;
pub mod settings;
pub mod stream;
#[cfg(test)]
mod tickets_model;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::algo::model::{self, CollKind, LinkCost, Tuning};
use crate::algo::{self, shm, Algo, Pipeline};
use crate::bootstrap::{self, env::Root, UniqueId};
use crate::error::{Error, ErrorKind, Result};
use crate::net::{self, NetHandle, NetKind};
use crate::types::{DataType, Element, RedOp};

use crate::device::Device;
use crate::exec::links::{Endpoint, Links};
use crate::exec::Exec;
pub(crate) use crate::exec::{Mem, MemMut};
pub use crate::os::wait::Waiter;

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
    /// during init (`ROCCL_CONNECT=all`; see [`Communicator::connect_all`]); by default
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
            },
            waiter: Waiter::from_env(),
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
/// both ranks, 4 windows, fills the cache) worse (docs/PERFORMANCE.md). Fixed rather than
/// derived from the cache size so that every rank splits alike.
pub const RING_WINDOW: usize = 4 << 20;

/// Default of [`Config::gpu_direct_min`]: on the simulated device over the userspace RoCE
/// engine, GPU-direct broadcasts overtake staged ones between 32 KiB and 512 KiB.
pub const GPU_DIRECT_MIN: usize = 64 << 10;

/// Per-call options.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallOpts {
    /// Force an algorithm for this call (if the collective has it).
    pub algo: Option<Algo>,
}

/// What a call did.
#[derive(Clone, Copy, Debug)]
pub struct CallInfo {
    /// Algorithm used (`None` for point-to-point and barrier).
    pub algo: Option<Algo>,
    /// Pipeline shape used.
    pub pipeline: Option<Pipeline>,
}

/// One collective operation, for the byte-level API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Every rank gets the reduction of all inputs.
    AllReduce(RedOp),
    /// Root's buffer to every rank.
    Broadcast {
        /// Source rank.
        root: usize,
    },
    /// Reduction of all inputs at the root.
    Reduce {
        /// Operation.
        op: RedOp,
        /// Destination rank.
        root: usize,
    },
    /// Concatenation of all inputs, in rank order, on every rank.
    AllGather,
    /// Reduction of all inputs, block `r` to rank `r`.
    ReduceScatter(RedOp),
    /// Block `j` of rank `i` goes to block `i` of rank `j`.
    AllToAll,
    /// Wait until every rank has arrived.
    Barrier,
    /// Send the input to `to` and/or receive the output from `from`.
    SendRecv {
        /// Destination rank.
        to: Option<usize>,
        /// Source rank.
        from: Option<usize>,
    },
}

/// One operation of a grouped point-to-point exchange ([`Communicator::p2p`]).
#[derive(Debug)]
pub enum P2p<'a> {
    /// Send `buf` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Bytes to send.
        buf: &'a [u8],
    },
    /// Receive exactly `buf.len()` bytes from `peer`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where to receive.
        buf: &'a mut [u8],
    },
}

/// A point-to-point operation on a caller buffer that may be GPU memory.
pub(crate) enum P2pMem<'a> {
    Send { peer: usize, buf: Mem<'a> },
    Recv { peer: usize, buf: MemMut<'a> },
}

impl P2pMem<'_> {
    fn peer(&self) -> usize {
        match self {
            P2pMem::Send { peer, .. } | P2pMem::Recv { peer, .. } => *peer,
        }
    }
    fn len(&self) -> usize {
        match self {
            P2pMem::Send { buf, .. } => buf.len(),
            P2pMem::Recv { buf, .. } => buf.len(),
        }
    }
}

/// The end of every error about ranks in different calls.
const MISMATCH_TEXT: &str =
    ": every rank must make the same collective calls, with the same arguments, in the same order";

/// What the cost model chose for a call.
type Choice = (Algo, Pipeline);

struct State {
    links: Links,
    /// Every rank's shared-memory segment, when all ranks are on this host.
    node: Option<crate::algo::shm::node::Node>,
    /// Scaled inputs of averages of narrow floats (see `avg_premultiplied`), kept from call
    /// to call.
    premul: Vec<u8>,
    /// The tag of the call in progress (`agree::call_tag`, with its algorithm).
    call_tag: u32,
    /// The model's last answer: collective, data type, bytes, forced algorithm → choice.
    last_choice: Option<(CollKind, DataType, usize, Option<Algo>, Choice)>,
    stage: Vec<u64>,
    /// The error that made the communicator unusable; shared with [`Shared::broken`] so that
    /// readers never wait for the call that holds the state.
    broken: Arc<Broken>,
    cfg: Config,
    cost: LinkCost,
    serving: u64,
    /// The worker thread's spin time (see `worker_wait`).
    worker_spin: Duration,
}

struct Shared {
    rank: usize,
    nranks: usize,
    net: &'static str,
    flat: bool,
    /// Smallest message of a GPU-direct call ([`Config::gpu_direct_min`]).
    gpu_direct_min: usize,
    /// Integrated GPUs go GPU-direct too ([`GpuDirect::On`]).
    gpu_direct_integrated: bool,
    /// GPU-direct is on and the network takes GPU memory.
    gpu_direct_net: bool,
    /// Per peer, how GPU memory goes to it without staging (see `Links::device_mem`).
    device_mem: Vec<Option<bool>>,
    state: Mutex<State>,
    /// Set once, read without a lock ([`Communicator::async_error`]).
    broken: Arc<Broken>,
    turn: Condvar,
    /// The next ticket. Tickets of non-blocking calls are taken with the worker's queue
    /// locked and queued before it is unlocked, so the worker receives its jobs in ticket
    /// order (see [`Communicator::submit`]).
    tickets: AtomicU64,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    /// How the worker thread waits for its next job (see [`Communicator::worker`]).
    worker_wait: Waiter,
    /// Raised by `abort` without the state lock, so a blocked call sees it.
    abort: Arc<std::sync::atomic::AtomicBool>,
}

/// Work for the worker thread, as it runs in a turn.
type Work = Box<dyn FnOnce(&mut State) + Send>;
type Job = (u64, Work);

/// The error that made a communicator unusable: set once (the first error wins), read
/// without waiting by any thread.
#[derive(Default)]
struct Broken(std::sync::OnceLock<(ErrorKind, String)>);

impl Broken {
    fn get(&self) -> Option<&(ErrorKind, String)> {
        self.0.get()
    }
    /// Record `kind`/`msg` unless an earlier error is recorded; true if this one was.
    fn set(&self, kind: ErrorKind, msg: String) -> bool {
        self.0.set((kind, msg)).is_ok()
    }
    /// The error later calls get.
    fn error(&self) -> Option<Error> {
        self.get().map(|(_, b)| {
            Error::InvalidUsage(format!(
                "communicator is unusable after an earlier error: {b}"
            ))
        })
    }
}

/// The text of a panic's payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A group of ranks that run collectives together.
pub struct Communicator {
    shared: Arc<Shared>,
}

/// A non-blocking operation in flight; its buffer comes back from [`Handle::wait`].
pub struct Handle<R> {
    rx: mpsc::Receiver<Result<R>>,
    got: Option<Result<R>>,
    /// What the call ended with when it never answered (it panicked): the communicator's
    /// error.
    broken: Arc<Broken>,
}

impl<R> Handle<R> {
    /// True once the operation has finished (successfully or not).
    pub fn test(&mut self) -> bool {
        if self.got.is_none() {
            match self.rx.try_recv() {
                Ok(r) => self.got = Some(r),
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.got = Some(Err(self.broken.error().unwrap_or_else(|| {
                        Error::Internal("the call ended without an answer".into())
                    })))
                }
                Err(mpsc::TryRecvError::Empty) => {}
            }
        }
        self.got.is_some()
    }

    /// Block until the operation finishes; returns its buffer or its error.
    pub fn wait(mut self) -> Result<R> {
        if let Some(r) = self.got.take() {
            return r;
        }
        self.rx.recv().unwrap_or_else(|_| {
            Err(self.broken.error().unwrap_or_else(|| {
                Error::Internal(
                    "the call ended without an answer (communicator worker exited)".into(),
                )
            }))
        })
    }
}

/// The name a communicator reports: its network, or shared memory when every peer is on this
/// host, or both.
fn combined_name(net: &'static str, shm_peers: usize, other_peers: usize) -> &'static str {
    match (shm_peers, other_peers, net) {
        (0, _, n) => n,
        (_, 0, _) => "shm",
        (_, _, "tcp") => "tcp+shm",
        (_, _, "rocev2") => "rocev2+shm",
        (_, _, "verbs") => "verbs+shm",
        (_, _, n) => n,
    }
}

impl Communicator {
    /// Join the communicator of `id` as `rank` of `nranks`, with settings from the
    /// environment. Blocks until every rank has joined or `ROCCL_TIMEOUT` passes (the error
    /// then names the ranks that never arrived).
    pub fn init(id: &UniqueId, nranks: usize, rank: usize) -> Result<Communicator> {
        Self::init_with(id, nranks, rank, Config::from_env()?)
    }

    /// Join with explicit settings.
    pub fn init_with(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
    ) -> Result<Communicator> {
        Self::init_abortable(
            id,
            nranks,
            rank,
            cfg,
            &std::sync::atomic::AtomicBool::new(false),
        )
    }

    /// [`Communicator::init_with`] that another thread can end: setting `abort` makes the
    /// waits of initialization (the rendezvous, the shared-memory attach) return an error
    /// within about 100 ms (what `rocclCommAbort` does to a non-blocking init).
    pub fn init_abortable(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
        abort: &std::sync::atomic::AtomicBool,
    ) -> Result<Communicator> {
        if nranks == 0 {
            return Err(Error::arg("nranks must be at least 1"));
        }
        if rank >= nranks {
            return Err(Error::arg(format!(
                "rank {rank} is out of range for {nranks} ranks (ranks are 0..{})",
                nranks - 1
            )));
        }
        let (root, nonce) = id.root()?;
        let local = bootstrap::ifaces::local_addr(Some(root.ip()))?;
        let net: Arc<dyn net::Net> = net::open(cfg.net, local)?;
        // The network's own waits (retransmission, draining at close) end at this
        // communicator's deadline, not at one read from the environment.
        net.set_timeout(cfg.waiter.timeout);
        // Whether GPU memory can go to peers over this network. Connections keep eager
        // messages: the executor hands the network a GPU copy for those.
        let net_gpu = if cfg.gpu_direct != GpuDirect::Off {
            let p = net.properties(0)?.ptr_support;
            if p.dmabuf || p.device {
                Some(p.dmabuf)
            } else {
                crate::info!(
                    "GPU-direct (ROCCL_GPU_DIRECT) is not possible: {} cannot take GPU memory (it needs an RDMA NIC with dmabuf or peer-memory support): GPU buffers are staged through host memory",
                    net.name()
                );
                None
            }
        } else {
            None
        };
        let (handle, listen) = net.listen(0)?;
        // With `auto`, ranks of one host also get a shared-memory endpoint (ROCCL_SHM=0: no).
        let shm = if cfg.net == NetKind::Auto && crate::envvar::switch_or("ROCCL_SHM", true) {
            match net::shm::ShmNet::new().and_then(|n| {
                let (h, l) = net::Net::listen(&n, 0)?;
                Ok((Arc::new(n) as Arc<dyn net::Net>, h, l))
            }) {
                Ok(s) => Some(s),
                Err(e) => {
                    crate::info!(
                        "shared memory unavailable ({e}): peers on this host use {}",
                        net.name()
                    );
                    None
                }
            }
        } else {
            None
        };
        // Segments for collectives through shared memory, created before the rendezvous so
        // that peers on this host can map them once it is over.
        let tag = nonce ^ ((nranks as u64) << 48);
        let node_seg = if nranks > 1 && (shm.is_some() || cfg.net == NetKind::Shm) {
            let slot = cfg.shm_slot.unwrap_or(crate::algo::shm::node::DEFAULT_SLOT);
            match crate::algo::shm::node::NodeSeg::create(tag, rank, slot) {
                Ok(s) => Some(s),
                Err(e) => {
                    crate::info!("shared-memory collectives unavailable on rank {rank}: {e}");
                    None
                }
            }
        } else {
            None
        };
        let props = net.properties(0)?;
        let mine = agree::settings(&cfg, stream::ops::stream_chunk()?);
        let table = bootstrap::rendezvous_abortable(
            id,
            rank,
            nranks,
            &agree::blob(
                &handle,
                net.name(),
                shm.as_ref().map(|s| &s.1),
                node_seg.is_some(),
                &mine,
                agree::HostInputs {
                    cores: crate::os::host_cores() as u32,
                    latency_us: props.latency_us,
                    speed_mbps: props.speed_mbps,
                },
            ),
            cfg.waiter.timeout,
            abort,
        )
        .inspect_err(|_| {
            if node_seg.is_some() {
                // A rank killed meanwhile cannot unlink its own segment.
                crate::algo::shm::node::remove_dead_segments(tag, rank, nranks);
            }
        })?;
        let blobs = table
            .iter()
            .enumerate()
            .map(|(r, b)| agree::parse_blob(r, b, rank, net.name(), &mine))
            .collect::<Result<Vec<_>>>()?;
        let my_host = blobs[rank].host;
        let local_ranks = blobs.iter().filter(|b| b.host == my_host).count();
        let cores = crate::os::host_cores();
        let mut cfg = cfg;
        cfg.waiter.fit(local_ranks, cores);
        // The worker thread (stream-ordered and non-blocking calls) polls between jobs: it
        // spins only with a core for it next to the application's thread of every rank, and
        // otherwise yields (2 cores, 2 ranks, simulated device: 8 B stream-ordered all-reduce
        // 23.5 µs blocking in the channel at once, 13.4 µs yielding first; docs/PERFORMANCE.md).
        let worker_wait = Waiter {
            spin: if cores >= 2 * local_ranks {
                cfg.waiter.spin
            } else {
                Duration::ZERO
            },
            ..cfg.waiter.clone()
        };
        // Peers on this host that offer shared memory are reached through it.
        let peer_net: Vec<usize> = (0..nranks)
            .map(|p| {
                let same_host = blobs[p].host == my_host;
                usize::from(shm.is_some() && same_host && blobs[p].shm.is_some())
            })
            .collect();
        let all_have_node = blobs.iter().all(|b| b.node);
        let measured = agree::slowest_speeds(&blobs);
        let shm_net = net.name() == "shm";
        let handles: Vec<Vec<NetHandle>> = blobs
            .iter()
            .map(|b| {
                let s = b.shm.clone().unwrap_or_else(|| b.handle.clone());
                vec![b.handle.clone(), s]
            })
            .collect();
        let shm_peers = (0..nranks)
            .filter(|&p| p != rank && peer_net[p] == 1)
            .count();
        let other_peers = nranks - 1 - shm_peers;
        // Peers on this host talk through the kernel's loopback path whatever the interface.
        let all_local = local_ranks == nranks;
        // Every rank on this host with its segment: map them all (every rank decides alike).
        let node = match node_seg {
            Some(own) if all_local && all_have_node => {
                crate::algo::shm::node::Node::attach(own, tag, rank, nranks, &cfg.waiter, abort)?
            }
            _ => None,
        };
        // The same cost inputs on every rank, however the hosts differ (agree.rs).
        let cost = agree::agreed_cost(&blobs, shm_net, node.as_ref().map(|n| (n.slot(), n.cma())));
        let name = combined_name(net.name(), shm_peers, other_peers);
        if let Some(n) = &node {
            crate::info!(
                "rank {rank}: collectives through shared segments on ({} KiB slots; single-copy broadcasts: {})",
                n.slot() >> 10,
                if n.cma() { "yes" } else { "no, process_vm_readv refused" }
            );
        }
        crate::info!(
            "rank {rank}/{nranks}: net {name} on {} ({}), {local_ranks} rank(s) on this host with {cores} core(s): spin {:?}, yield {:?}, timeout {:?}; cost model α={:.1}µs β={:.2}GB/s message cpu {:.1}µs γ={:.1}GB/s copy {:.1}GB/s (from measured speeds, slowest rank: reduce {:.1}GB/s, copy {:.1}GB/s)",
            props.name,
            local,
            cfg.waiter.spin,
            cfg.waiter.yield_for,
            cfg.waiter.timeout,
            cost.alpha_us,
            cost.beta_gbs,
            cost.msg_cpu_us,
            cost.gamma_gbs,
            cost.copy_gbs,
            measured.reduce_gbs,
            measured.copy_gbs
        );
        let mut endpoints = vec![Endpoint {
            net,
            dev: 0,
            listen,
        }];
        if let Some((n, _, l)) = shm {
            endpoints.push(Endpoint {
                net: n,
                dev: 0,
                listen: l,
            });
        }
        let links = Links::new(
            rank,
            nranks,
            (nonce ^ (nonce >> 32)) as u32,
            endpoints,
            peer_net,
            handles,
        );
        let mut links = links;
        // Peers reached over the network that takes GPU memory (not over shared memory).
        links.device_mem = (0..nranks)
            .map(|p| net_gpu.filter(|_| links.peer_net[p] == 0))
            .collect();
        let device_mem = links.device_mem.clone();
        links.timeout_grace =
            (cfg.waiter.timeout / 2).clamp(Duration::from_millis(500), Duration::from_secs(2));
        let abort_flag = Arc::clone(&links.abort);
        let connect_all = cfg.connect_all;
        let broken = Arc::new(Broken::default());
        let comm = Communicator {
            shared: Arc::new(Shared {
                rank,
                nranks,
                net: name,
                flat: node.is_some(),
                gpu_direct_min: cfg.gpu_direct_min,
                gpu_direct_integrated: cfg.gpu_direct == GpuDirect::On,
                gpu_direct_net: net_gpu.is_some(),
                device_mem,
                state: Mutex::new(State {
                    links,
                    node,
                    premul: Vec::new(),
                    call_tag: 0,
                    last_choice: None,
                    stage: Vec::new(),
                    broken: Arc::clone(&broken),
                    cfg,
                    cost,
                    serving: 0,
                    worker_spin: worker_wait.spin,
                }),
                broken,
                turn: Condvar::new(),
                tickets: AtomicU64::new(0),
                worker: Mutex::new(None),
                worker_wait,
                abort: abort_flag,
            }),
        };
        if connect_all {
            comm.connect_all()?;
        }
        Ok(comm)
    }

    /// Join from the launcher's environment: `ROCCL_UNIQUE_ID`, or `ROCCL_ROOT` /
    /// torchrun / Slurm / Open MPI variables (see [`bootstrap::env`]). With an address root,
    /// rank 0 serves the root on it.
    pub fn from_env() -> Result<Communicator> {
        let info = bootstrap::env::from_env()?;
        let cfg = Config::from_env()?;
        let id = match &info.root {
            Root::UniqueIdHex(h) => UniqueId::from_hex(h)?,
            Root::Addr { host, port } => {
                let addr = resolve(host, *port)?;
                if info.rank == 0 {
                    bootstrap::serve_root(addr)?
                } else {
                    UniqueId::for_address(addr)
                }
            }
        };
        Self::init_with(&id, info.nranks, info.rank, cfg)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.shared.nranks
    }

    /// Name of the network in use (`tcp`, ...).
    pub fn net_name(&self) -> &'static str {
        self.shared.net
    }

    /// Whether the shared-memory collectives (`shm1`, `shm2`) are available: every rank is
    /// on this host and all of them mapped each other's segments.
    pub fn shm_collectives(&self) -> bool {
        self.shared.flat
    }

    /// The error that made this communicator unusable, if any.
    pub fn async_error(&self) -> Option<String> {
        self.async_error_kind().map(|e| e.1)
    }

    /// The error that made this communicator unusable, with its class. Never waits: a call
    /// in progress on another thread does not hold it.
    pub fn async_error_kind(&self) -> Option<(ErrorKind, String)> {
        self.shared.broken.get().cloned()
    }

    /// Close all connections now; pending and later calls fail.
    ///
    /// Safe to call from any thread while another thread is blocked in a collective on this
    /// communicator: the blocked call notices within one wait pass (at most ~20 ms when
    /// sleeping) and returns an error; then the connections are closed.
    pub fn abort(&self) {
        self.shared.abort.store(true, Ordering::SeqCst);
        self.shared.broken.set(
            ErrorKind::InvalidUsage,
            "communicator aborted by the application".into(),
        );
        let mut st = self.shared.state.lock();
        if let Some(node) = &st.node {
            node.mark_broken();
        }
        st.links.close_all();
    }

    /// Algorithm and pipeline the cost model picks for a collective of `bytes` bytes.
    pub fn plan(
        &self,
        kind: CollKind,
        dt: DataType,
        bytes: usize,
        algo: Option<Algo>,
    ) -> (Algo, Pipeline) {
        let st = self.shared.state.lock();
        model::choose_for(
            kind,
            dt,
            self.shared.nranks,
            bytes,
            &st.cost,
            algo.or(st.cfg.algo),
            &st.cfg.tuning,
        )
    }

    /// Whether a call of `coll` on GPU memory moves it without staging: `ROCCL_GPU_DIRECT`
    /// is on, the collective moves data without reducing it (broadcast, all-gather,
    /// all-to-all, send/receive), its messages (`message_bytes`: a broadcast's buffer, a
    /// rank's block of an all-gather or all-to-all) are at least
    /// [`Config::gpu_direct_min`], and every peer it may talk to is reached over a network
    /// that takes GPU memory (so no algorithm runs through the host's shared-memory
    /// segments). `peer`: the one peer of a send or receive. `integrated`: the memory
    /// belongs to an integrated GPU (GPU-direct only with [`GpuDirect::On`]).
    pub fn gpu_direct(
        &self,
        coll: &Collective,
        peer: Option<usize>,
        message_bytes: usize,
        integrated: bool,
    ) -> bool {
        if !self.shared.gpu_direct_net
            || message_bytes < self.shared.gpu_direct_min
            || (integrated && !self.shared.gpu_direct_integrated)
        {
            return false;
        }
        let moves_only = matches!(
            coll,
            Collective::Broadcast { .. }
                | Collective::AllGather
                | Collective::AllToAll
                | Collective::SendRecv { .. }
        );
        let me = self.shared.rank;
        let reach =
            |p: usize| p == me || self.shared.device_mem.get(p).copied().flatten().is_some();
        moves_only
            && !self.shared.flat
            && match peer {
                Some(p) => reach(p),
                None => (0..self.shared.nranks).all(reach),
            }
    }

    /// [`Communicator::run_raw`] on buffers that may be GPU memory (`dev`: its runtime;
    /// only collectives that [`Communicator::gpu_direct`] allows).
    pub(crate) fn run_mem(
        &self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.with_turn(|st| st.execute_mem(coll, dt, send, recv, &CallOpts::default(), dev))
    }

    /// [`Communicator::p2p`] on buffers that may be GPU memory.
    pub(crate) fn p2p_mem(
        &self,
        ops: &mut [P2pMem<'_>],
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()> {
        self.with_turn(|st| st.p2p_mem(ops, dev))
    }

    fn with_turn<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let t = self.shared.tickets.fetch_add(1, Ordering::SeqCst);
        run_turn(&self.shared, t, f)
    }

    /// Run one collective on byte buffers. `send == None` means in place. See each typed
    /// method for the buffer sizes each collective expects.
    pub fn run_raw(
        &self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.with_turn(|st| st.execute(coll, dt, send, recv, opts))
    }

    fn typed<T: Element>(
        &self,
        coll: Collective,
        send: Option<&[T]>,
        recv: &mut [T],
    ) -> Result<()> {
        let s = send.map(bytemuck::cast_slice::<T, u8>);
        self.run_raw(
            coll,
            T::DTYPE,
            s,
            bytemuck::cast_slice_mut(recv),
            &CallOpts::default(),
        )
        .map(|_| ())
    }

    /// All-reduce: `recv[i] = op over ranks of send[i]`; both have the same length.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::AllReduce(op), Some(send), recv)
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::AllReduce(op), None, buf)
    }

    /// Broadcast `buf` from `root` to every rank (in place).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.typed(Collective::Broadcast { root }, None, buf)
    }

    /// Broadcast `send` of `root` into `recv` of every rank (`send` is read on the root only).
    pub fn broadcast_from<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.typed(Collective::Broadcast { root }, Some(send), recv)
    }

    /// Reduce `send` of every rank into `recv` of `root` (`recv` is untouched elsewhere and
    /// may be empty there).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: RedOp,
        root: usize,
    ) -> Result<()> {
        self.typed(Collective::Reduce { op, root }, Some(send), recv)
    }

    /// In-place reduce: `buf` is the input everywhere and the output on `root`.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp, root: usize) -> Result<()> {
        self.typed(Collective::Reduce { op, root }, None, buf)
    }

    /// All-gather: `recv` (`nranks * send.len()`) gets every rank's `send` in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(Collective::AllGather, Some(send), recv)
    }

    /// In-place all-gather: this rank's input is block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed(Collective::AllGather, None, buf)
    }

    /// Reduce-scatter: `send` (`nranks * recv.len()`) reduced over ranks; block `rank` to `recv`.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::ReduceScatter(op), Some(send), recv)
    }

    /// In-place reduce-scatter: the result lands in block `rank` of `buf`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        self.typed(Collective::ReduceScatter(op), None, buf)
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, block `i` of `recv` comes from rank `i`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(Collective::AllToAll, Some(send), recv)
    }

    /// In-place all-to-all.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed(Collective::AllToAll, None, buf)
    }

    /// Send `buf` to `peer` (returns when `peer` has received it or the network holds it).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.typed(
            Collective::SendRecv {
                to: Some(peer),
                from: None,
            },
            Some(buf),
            &mut [],
        )
    }

    /// Receive `buf` from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let none: &[T] = &[];
        self.typed(
            Collective::SendRecv {
                to: None,
                from: Some(peer),
            },
            Some(none),
            buf,
        )
    }

    /// Send `send` to `to` while receiving `recv` from `from` (no deadlock when peers
    /// exchange with each other).
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.typed(
            Collective::SendRecv {
                to: Some(to),
                from: Some(from),
            },
            Some(send),
            recv,
        )
    }

    /// Run several sends and receives at once, to and from any peers: all are posted
    /// together, so exchanges in any pattern cannot deadlock. Messages between two ranks
    /// are matched in the order each side lists them. A send to oneself is matched with the
    /// next receive from oneself.
    pub fn p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.with_turn(|st| st.p2p(ops))
    }

    /// Split into sub-communicators: ranks with the same `color` form one, ordered by
    /// `key` then by rank here. `color == None` takes part but gets no communicator back.
    /// Every rank of this communicator must call it.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        let n = self.nranks();
        let me = self.rank();
        let mine = [color.map_or(-1i64, i64::from), i64::from(key)];
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&mine, &mut all)?;
        let members = |c: i64| {
            let mut m: Vec<usize> = (0..n).filter(|&r| all[2 * r] == c).collect();
            m.sort_by_key(|&r| (all[2 * r + 1], r));
            m
        };
        let group = color.map(|c| members(i64::from(c))).unwrap_or_default();
        // The first member of each group creates the new root and everyone learns its id.
        let mut id = [0u8; crate::bootstrap::UNIQUE_ID_BYTES];
        let mut created = Ok(());
        if group.first() == Some(&me) {
            match UniqueId::new() {
                Ok(u) => id.copy_from_slice(u.as_bytes()),
                Err(e) => created = Err(e),
            }
        }
        let mut ids = vec![0u8; n * id.len()];
        self.all_gather(&id, &mut ids)?;
        created?;
        let Some(&leader) = group.first() else {
            return Ok(None);
        };
        let uid = UniqueId::from_bytes(&ids[leader * id.len()..(leader + 1) * id.len()]).map_err(
            |_| Error::Remote {
                rank: leader,
                msg: format!("rank {leader} could not create the root of the split communicator"),
            },
        )?;
        let cfg = self.shared.state.lock().cfg.clone();
        let pos = group
            .iter()
            .position(|&r| r == me)
            .expect("member of own group");
        Communicator::init_with(&uid, group.len(), pos, cfg).map(Some)
    }

    /// Block until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.run_raw(
            Collective::Barrier,
            DataType::U8,
            None,
            &mut [],
            &CallOpts::default(),
        )
        .map(|_| ())
    }

    /// Open now, to and from every peer, the connections calls use with the default
    /// pipeline: channels 0 and 1 (one-shot, two-shot, doubling, rings of up to two
    /// channels, both trees of the double tree) and the point-to-point channel. What
    /// `ROCCL_CONNECT=all` does during init; a collective call: every rank must make it.
    /// (Rings forced to more channels, `ROCCL_NCHANNELS`, still open those when first used.)
    pub fn connect_all(&self) -> Result<()> {
        self.with_turn(|st| {
            let (n, me) = (st.links.nranks, st.links.rank);
            let peers: Vec<(usize, usize)> = (0..n)
                .filter(|&p| p != me)
                .flat_map(|p| [(p, 0), (p, 1), (p, crate::algo::P2P_CHANNEL)])
                .collect();
            st.usable()?;
            let r = st.links.ensure(&peers, &peers, &st.cfg.waiter);
            if let Err(e) = &r {
                st.failed(e);
            }
            r
        })
    }

    /// Connections this rank has open: (sends, receives) over every peer and channel.
    pub fn open_connections(&self) -> (usize, usize) {
        self.with_turn(|st| st.links.open())
    }

    /// Queue `job` for the worker thread with the next ticket. The ticket is taken and the
    /// job queued with the queue locked, so the worker receives jobs in ticket order (a job
    /// queued after a later ticket's would wait for its turn forever). The worker thread is
    /// started, if need be, before a ticket is taken: when it cannot start, no ticket is
    /// lost and the job comes back with the error.
    fn submit(&self, job: Work) -> std::result::Result<(), (Work, Error)> {
        let mut w = self.shared.worker.lock();
        if w.is_none() {
            match self.spawn_worker() {
                Ok(tx) => *w = Some(tx),
                Err(e) => return Err((job, e)),
            }
        }
        let tx = w.as_ref().expect("worker started above");
        let t = self.shared.tickets.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::SendError((t, job))) = tx.send((t, job)) {
            // The worker is gone (it only ends when the queue closes, which needs the
            // communicator dropped): run the job here, in its turn.
            drop(w);
            run_turn(&self.shared, t, job);
        }
        Ok(())
    }

    fn spawn_worker(&self) -> Result<mpsc::Sender<Job>> {
        #[cfg(test)]
        if tests::SPAWN_FAILS.with(|f| f.get()) {
            return Err(Error::sys(
                "starting the communicator's worker thread",
                std::io::Error::from_raw_os_error(libc::EAGAIN),
            ));
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::clone(&self.shared);
        let waiter = self.shared.worker_wait.clone();
        // A job that panics has broken the communicator (see `run_turn`); the worker goes on
        // with the next, which fails at once, rather than leaving queued tickets unserved.
        let run = move |shared: &Shared, (t, job): Job| {
            let _ =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_turn(shared, t, job)));
        };
        std::thread::Builder::new()
            .name(format!("roccl-r{}", self.shared.rank))
            .spawn(move || {
                // Between jobs, poll the queue as the waiting policy says (spin with a core
                // per rank, yield when sharing) before sleeping in the channel: the next
                // layer's call usually comes within microseconds, and a futex wake-up costs
                // more than the collective itself.
                let mut ws = waiter.start();
                loop {
                    match rx.try_recv() {
                        Ok(job) => {
                            run(&shared, job);
                            ws.progressed();
                        }
                        Err(mpsc::TryRecvError::Disconnected) => return,
                        Err(mpsc::TryRecvError::Empty) => {
                            if matches!(ws.pause(), Ok(true) | Err(_)) {
                                match rx.recv() {
                                    Ok(job) => run(&shared, job),
                                    Err(_) => return,
                                }
                                ws.progressed();
                            }
                        }
                    }
                }
            })
            .map_err(|e| Error::sys("starting the communicator's worker thread", e))
            .map(|_| tx)
    }

    /// Run `coll` in the background on owned buffers; `send == None` means in place. The
    /// call is ordered with every other call on this communicator by issue time.
    pub fn start<T: Element>(
        &self,
        coll: Collective,
        send: Option<Vec<T>>,
        mut recv: Vec<T>,
    ) -> Handle<Vec<T>> {
        let (tx, rx) = mpsc::channel();
        let answer = tx.clone();
        let job = Box::new(move |st: &mut State| {
            let s = send.as_deref().map(bytemuck::cast_slice::<T, u8>);
            let r = st.execute(
                coll,
                T::DTYPE,
                s,
                bytemuck::cast_slice_mut(&mut recv),
                &CallOpts::default(),
            );
            let _ = tx.send(r.map(|_| recv));
        });
        if let Err((job, e)) = self.submit(job) {
            // Not started, no ticket taken: the call fails alone.
            drop(job);
            let _ = answer.send(Err(e));
        }
        Handle {
            rx,
            got: None,
            broken: Arc::clone(&self.shared.broken),
        }
    }

    /// Non-blocking in-place all-reduce.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: RedOp) -> Handle<Vec<T>> {
        self.start(Collective::AllReduce(op), None, buf)
    }

    /// Run `job` on this communicator's worker thread, ordered with every other call on it
    /// by issue time; returns at once. The job gets the communicator's [`Turn`]: what the
    /// stream-ordered collectives of [`crate::device`] run their work with.
    pub fn enqueue(&self, job: Box<dyn FnOnce(&mut Turn) + Send>) {
        let abort = Arc::clone(&self.shared.abort);
        let job: Box<dyn FnOnce(&mut State) + Send> = Box::new(move |st: &mut State| {
            let mut turn = Turn { st, abort: &abort };
            job(&mut turn)
        });
        if let Err((job, e)) = self.submit(job) {
            // No worker: run it on this thread in its turn (streams may wait on what it
            // signals, so it must run).
            crate::warn!(
                "rank {}: {e}; running a stream-ordered call on the calling thread",
                self.shared.rank
            );
            self.with_turn(job);
        }
    }
}

/// A communicator's turn on its worker thread: collectives and point-to-point exchanges
/// run from here without taking another turn (see [`Communicator::enqueue`]).
pub struct Turn<'a> {
    st: &'a mut State,
    abort: &'a std::sync::atomic::AtomicBool,
}

impl Turn<'_> {
    /// [`Communicator::run_raw`], within this turn.
    pub fn run_raw(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.st.execute(coll, dt, send, recv, opts)
    }

    /// [`Communicator::p2p`], within this turn.
    pub fn p2p(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.st.p2p(ops)
    }

    /// [`Communicator::run_mem`], within this turn.
    pub(crate) fn run_mem(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.st
            .execute_mem(coll, dt, send, recv, &CallOpts::default(), dev)
    }

    /// [`Communicator::p2p_mem`], within this turn.
    pub(crate) fn p2p_mem(
        &mut self,
        ops: &mut [P2pMem<'_>],
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()> {
        self.st.p2p_mem(ops, dev)
    }

    /// Record `e` as the communicator's error (nobody waits for this call's result: the
    /// application learns it from [`Communicator::async_error`]); argument errors too.
    pub fn fail(&mut self, e: &Error) {
        if self.st.broken.set(e.kind(), e.to_string()) {
            if let Some(node) = &self.st.node {
                node.mark_broken();
            }
        }
    }

    /// How long the worker thread spins before yielding (zero unless every rank of this
    /// host has a spare core for its worker).
    pub fn spin(&self) -> Duration {
        self.st.worker_spin
    }

    /// How long a wait may go without progress before it fails (`ROCCL_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.st.cfg.waiter.timeout
    }

    /// Whether the application aborted the communicator.
    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Stop the worker after the jobs already queued.
        self.shared.worker.lock().take();
    }
}

/// Run `f` in turn `t`. The turn always advances, also when `f` panics: the communicator is
/// then broken with the panic's text as its error, and the panic goes on to the caller.
fn run_turn<R>(shared: &Shared, t: u64, f: impl FnOnce(&mut State) -> R) -> R {
    let mut st = shared.state.lock();
    while st.serving != t {
        shared.turn.wait(&mut st);
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut st)));
    if let Err(p) = &r {
        let msg = format!(
            "a call on rank {} panicked: {} (a bug in roccl or in a job given to enqueue)",
            shared.rank,
            panic_text(&**p)
        );
        if st.broken.set(ErrorKind::Internal, msg) {
            if let Some(node) = &st.node {
                node.mark_broken();
            }
        }
        st.links.close_all();
    }
    st.serving += 1;
    shared.turn.notify_all();
    drop(st);
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::sys(format!("resolving the root host '{host}'"), e))?;
    addrs
        .next()
        .ok_or_else(|| Error::arg(format!("root host '{host}' has no address")))
}

/// An average of 16- and 8-bit floats overflows when summed first (8 ranks × f16 10000 sum
/// to inf; 4 ranks × e4m3 300 saturate at 448): as NCCL does, each rank's input is divided
/// by the number of ranks first and the call runs as a sum. All-reduce scales into its output
/// and runs in place; reduce and reduce-scatter scale into `scratch` (kept from call to
/// call; the caller's input is never written). `f32` and `f64` sum, then divide: exact for
/// the usual inputs, and their sums overflow only past 3.4e38 (1.8e308) per element.
/// Integers sum in their type (wrapping, as NCCL) and divide toward zero. Other calls come
/// back as they are.
#[allow(clippy::type_complexity)]
fn avg_premultiplied<'a>(
    coll: Collective,
    dt: DataType,
    (me, n): (usize, usize),
    send: Option<Mem<'a>>,
    recv: MemMut<'a>,
    scratch: &'a mut Vec<u8>,
) -> Result<(Collective, Option<Mem<'a>>, MemMut<'a>)> {
    let narrow = matches!(
        dt,
        DataType::F16 | DataType::Bf16 | DataType::F8E4M3 | DataType::F8E5M2
    );
    let (sum, input_len) = match coll {
        Collective::AllReduce(RedOp::Avg) => (Collective::AllReduce(RedOp::Sum), recv.len()),
        Collective::Reduce {
            op: RedOp::Avg,
            root,
        } => (
            Collective::Reduce {
                op: RedOp::Sum,
                root,
            },
            send.map_or(recv.len(), |s| s.len()),
        ),
        Collective::ReduceScatter(RedOp::Avg) => (
            Collective::ReduceScatter(RedOp::Sum),
            send.map_or(recv.len(), |s| s.len()),
        ),
        _ => return Ok((coll, send, recv)),
    };
    // Wrong lengths go on unchanged, to the checks that report them. (Reductions are on
    // host memory here: GPU buffers of reducing calls are staged before.)
    let fits = send.map_or(true, |s| s.len() == input_len)
        && input_len % dt.size() == 0
        && match sum {
            Collective::ReduceScatter(_) => {
                input_len % (dt.size() * n) == 0 && (send.is_none() || recv.len() * n == input_len)
            }
            _ => true,
        };
    if !narrow || n == 1 || !fits {
        return Ok((coll, send, recv));
    }
    if let Collective::AllReduce(_) = coll {
        let out = recv.into_slice()?;
        if let Some(s) = host(send)? {
            crate::reduce::copy_large(out, s);
        }
        crate::reduce::finish_avg(out, dt, n)?;
        return Ok((sum, None, MemMut::host(out)));
    }
    // Reduce and reduce-scatter read their input into the scratch buffer, scaled.
    scratch.resize(input_len, 0);
    let recv = if let Some(s) = host(send)? {
        scratch.copy_from_slice(s);
        recv
    } else {
        let out = recv.into_slice()?;
        scratch.copy_from_slice(out);
        match sum {
            // In place, the result is this rank's block of the buffer.
            Collective::ReduceScatter(_) => {
                let block = input_len / n;
                MemMut::host(&mut out[me * block..(me + 1) * block])
            }
            _ => MemMut::host(out),
        }
    };
    crate::reduce::finish_avg(scratch, dt, n)?;
    Ok((sum, Some(Mem::host(scratch)), recv))
}

/// The bytes of a read-only caller buffer, for code that reads with the CPU.
fn host<'a>(m: Option<Mem<'a>>) -> Result<Option<&'a [u8]>> {
    m.map(|m| m.slice()).transpose()
}

fn elems(what: &str, len: usize, dt: DataType) -> Result<usize> {
    if len % dt.size() != 0 {
        return Err(Error::arg(format!(
            "{what} of {len} bytes is not a whole number of {dt} elements ({} bytes each)",
            dt.size()
        )));
    }
    Ok(len / dt.size())
}

impl State {
    fn p2p(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let mut m = crate::algo::StackVec::<P2pMem, 64>::default();
        for o in ops.iter_mut() {
            m.push(match o {
                P2p::Send { peer, buf } => P2pMem::Send {
                    peer: *peer,
                    buf: Mem::host(buf),
                },
                P2p::Recv { peer, buf } => P2pMem::Recv {
                    peer: *peer,
                    buf: MemMut::host(buf),
                },
            });
        }
        self.p2p_mem(m.as_mut_slice(), None)
    }

    /// [`State::p2p`] on caller buffers that may be GPU memory (`dev`: its runtime).
    fn p2p_mem(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()> {
        self.usable()?;
        let (n, me) = (self.links.nranks, self.links.rank);
        for o in ops.iter() {
            let p = o.peer();
            if p >= n {
                return Err(Error::arg(format!(
                    "peer {p} is out of range for {n} ranks"
                )));
            }
        }
        let self_lens = |send: bool| -> Vec<usize> {
            ops.iter()
                .filter(|o| o.peer() == me && matches!(o, P2pMem::Send { .. }) == send)
                .map(|o| o.len())
                .collect()
        };
        let (self_sends, self_recvs) = (self_lens(true), self_lens(false));
        if self_sends != self_recvs {
            return Err(Error::arg(format!(
                "sends to self ({self_sends:?} bytes) do not match receives from self ({self_recvs:?} bytes)"
            )));
        }
        let r = self.p2p_inner(ops, dev);
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    fn p2p_inner(&mut self, ops: &mut [P2pMem<'_>], dev: Option<&Arc<dyn Device>>) -> Result<()> {
        use crate::algo::P2P_CHANNEL;
        use crate::exec::Reg;
        let me = self.links.rank;
        self.stage(64);
        let stage = &mut bytemuck::cast_slice_mut(&mut self.stage)[..64];
        let mut ex = Exec::new(
            None,
            MemMut::host(&mut []),
            stage,
            &mut self.links,
            &self.cfg.waiter,
            dev,
        );
        // Each operation's buffer becomes caller buffer `i`; (send, peer, region) per
        // operation on the stack for the usual few (no allocation per call).
        let mut posts = crate::algo::StackVec::<(bool, usize, Reg), 64>::default();
        for o in ops.iter_mut() {
            let post = match o {
                P2pMem::Send { peer, buf } => {
                    (true, *peer, Reg::new(ex.add_read(*buf), 0, buf.len()))
                }
                P2pMem::Recv { peer, buf } => {
                    let len = buf.len();
                    (false, *peer, Reg::new(ex.add_write(buf.take()), 0, len))
                }
            };
            posts.push(post);
        }
        let posts = posts.as_slice();
        let links = |send: bool| {
            posts
                .iter()
                .filter(move |p| p.0 == send && p.1 != me)
                .map(|p| (p.1, P2P_CHANNEL))
        };
        ex.ensure(links(true), links(false))?;
        let mut self_sends = posts.iter().filter(|p| p.0 && p.1 == me).map(|p| p.2);
        for &(send, peer, reg) in posts {
            match (send, peer == me) {
                (true, false) => {
                    ex.send(peer, P2P_CHANNEL, reg)?;
                }
                (false, false) => {
                    ex.recv(peer, P2P_CHANNEL, reg)?;
                }
                (false, true) => {
                    let from = self_sends
                        .next()
                        .ok_or_else(|| Error::Internal("unmatched receive from self".into()))?;
                    ex.copy(reg, from)?;
                }
                (true, true) => {}
            }
        }
        ex.finish()?;
        ex.device_done()
    }

    fn stage(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8) + 8;
        if self.stage.len() < words {
            self.stage = vec![0u64; words.next_power_of_two()];
        }
        &mut bytemuck::cast_slice_mut(&mut self.stage)[..bytes]
    }

    fn choose(
        &mut self,
        kind: CollKind,
        dt: DataType,
        bytes: usize,
        opts: &CallOpts,
    ) -> (Algo, Pipeline) {
        let forced = opts.algo.or(self.cfg.algo);
        // Calls repeat (one all-reduce per layer): the last choice is kept.
        if let Some((k, d, b, f, choice)) = self.last_choice {
            if k == kind && d == dt && b == bytes && f == forced {
                self.call_tag = agree::with_algo(self.call_tag, choice.0);
                return choice;
            }
        }
        let choice = model::choose_for(
            kind,
            dt,
            self.links.nranks,
            bytes,
            &self.cost,
            forced,
            &self.cfg.tuning,
        );
        self.last_choice = Some((kind, dt, bytes, forced, choice));
        self.call_tag = agree::with_algo(self.call_tag, choice.0);
        choice
    }

    fn execute(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        opts: &CallOpts,
    ) -> Result<CallInfo> {
        self.execute_mem(
            coll,
            dt,
            send.map(Mem::host),
            MemMut::host(recv),
            opts,
            None,
        )
    }

    /// [`State::execute`] on caller buffers that may be GPU memory (`dev`: its runtime).
    fn execute_mem(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        opts: &CallOpts,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.usable()?;
        // The buffer every rank passes alike: a reduce's output may be empty off the root.
        // (A reduce-scatter's whole input: in place the buffer, out of place n blocks.)
        let bytes = match (coll, send) {
            (Collective::Reduce { .. }, Some(s)) => s.len(),
            (Collective::ReduceScatter(_), Some(_)) => recv.len() * self.links.nranks,
            _ => recv.len(),
        };
        self.call_tag = agree::call_tag(&coll, dt, bytes);
        // The scratch buffer of averages leaves `self` while the call borrows it.
        let mut scratch = std::mem::take(&mut self.premul);
        let r = match avg_premultiplied(
            coll,
            dt,
            (self.links.rank, self.links.nranks),
            send,
            recv,
            &mut scratch,
        ) {
            Ok((coll, send, recv)) => self.execute_inner(coll, dt, send, recv, opts, dev),
            Err(e) => Err(e),
        };
        self.premul = scratch;
        let r = r.map_err(|e| self.explain_mismatch(e));
        if let Err(e) = &r {
            self.failed(e);
        }
        self.call_tag = 0;
        r
    }

    /// A tag mismatch with a peer (the networks' error) as an error naming both ranks and
    /// both calls.
    fn explain_mismatch(&self, e: Error) -> Error {
        let Error::Remote { rank, msg } = &e else {
            return e;
        };
        match net::unexpected_tag_of(msg) {
            Some(theirs) => Error::Remote {
                rank: *rank,
                msg: format!(
                    "rank {} called {} but rank {rank} called {}{MISMATCH_TEXT}",
                    self.links.rank,
                    agree::describe(self.call_tag),
                    agree::differ(self.call_tag, theirs)
                ),
            },
            None => e,
        }
    }

    /// Refuse work once the communicator is broken.
    fn usable(&self) -> Result<()> {
        self.broken.error().map_or(Ok(()), Err)
    }

    /// After a failed call: argument errors are caught before any data moves; anything
    /// later leaves the peers mid-protocol, so the communicator cannot continue. Tell the
    /// other ranks whom to blame (unless the application aborted) and close everything.
    fn failed(&mut self, e: &Error) {
        if matches!(e, Error::InvalidArgument(_)) {
            return;
        }
        self.broken.set(e.kind(), e.to_string());
        let cause = match e {
            Error::Remote { rank, .. } => Some(*rank),
            _ => self.links.suspect,
        };
        if let Some(node) = &self.node {
            node.mark_broken_by(cause);
        }
        let by_app = self.links.abort.load(Ordering::Relaxed);
        if let (Error::Remote { rank, msg }, false) = (e, by_app) {
            if msg.contains(MISMATCH_TEXT) && self.links.mismatch.is_none() {
                // The peer would only see its connection close: tell it which call we are in.
                self.links
                    .notify_mismatch(*rank, self.call_tag, Duration::from_millis(300));
            }
        }
        if let Some(c) = cause.filter(|c| *c != self.links.rank && !by_app) {
            self.links.notify_abort(c, Duration::from_millis(500));
        }
        self.links.close_all();
    }

    fn execute_inner(
        &mut self,
        coll: Collective,
        dt: DataType,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        opts: &CallOpts,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        let (n, me) = (self.links.nranks, self.links.rank);
        let check_root = |root: usize| {
            if root >= n {
                Err(Error::arg(format!(
                    "root {root} is out of range for {n} ranks"
                )))
            } else {
                Ok(())
            }
        };
        let same_len = |s: Option<Mem>, want: usize, what: &str| match s {
            Some(s) if s.len() != want => Err(Error::arg(format!(
                "{what}: send buffer has {} bytes but {want} are expected",
                s.len()
            ))),
            _ => Ok(()),
        };
        let esz = dt.size();
        let info = |a: Algo, p: Pipeline| CallInfo {
            algo: Some(a),
            pipeline: Some(p),
        };
        match coll {
            Collective::AllReduce(op) => {
                let count = elems("all_reduce receive buffer", recv.len(), dt)?;
                same_len(send, recv.len(), "all_reduce")?;
                let (a, pl) = self.choose(CollKind::AllReduce, dt, recv.len(), opts);
                if count == 0 {
                    return Ok(info(a, pl));
                }
                if let Algo::ShmOneShot | Algo::ShmTwoShot = a {
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    let two_shot = a == Algo::ShmTwoShot;
                    self.run_flat(coll, dt, recv.len(), u8::from(two_shot), |f| {
                        shm::all_reduce_shm(f, dt, op, send, recv, two_shot)
                    })?;
                    return Ok(info(a, pl));
                }
                let need = match a {
                    Algo::Direct => algo::all_reduce_direct_stage(n, recv.len()),
                    Algo::Doubling => recv.len(),
                    Algo::TwoShot => algo::all_reduce_twoshot_stage(n, count, dt),
                    Algo::Ring => algo::all_reduce_ring_stage(&pl),
                    Algo::Tree => 2 * algo::tree_stage(&pl),
                    Algo::ShmOneShot | Algo::ShmTwoShot => unreachable!("ran above"),
                };
                let window = self.cfg.ring_window / esz * esz;
                if a == Algo::Ring && window > 0 && recv.len() > 2 * window {
                    let mut recv = recv;
                    let mut off = 0;
                    while off < recv.len() {
                        let len = window.min(recv.len() - off);
                        let s = send.map(|s| s.part(off, len));
                        let r = recv.part(off, len);
                        self.run_exec(s, r, dev, need, |ex| {
                            algo::all_reduce_ring(ex, dt, op, len / esz, &pl)
                        })?;
                        off += len;
                    }
                    return Ok(info(a, pl));
                }
                self.run_exec(send, recv, dev, need, |ex| match a {
                    Algo::Direct => algo::all_reduce_direct(ex, dt, op, count),
                    Algo::Doubling => algo::all_reduce_doubling(ex, dt, op, count),
                    Algo::TwoShot => algo::all_reduce_twoshot(ex, dt, op, count),
                    Algo::Ring => algo::all_reduce_ring(ex, dt, op, count, &pl),
                    Algo::Tree => algo::all_reduce_tree(ex, dt, op, count, &pl),
                    Algo::ShmOneShot | Algo::ShmTwoShot => unreachable!("ran above"),
                })?;
                Ok(info(a, pl))
            }
            Collective::Broadcast { root } => {
                check_root(root)?;
                let count = elems("broadcast buffer", recv.len(), dt)?;
                let send = if me == root { send } else { None };
                same_len(send, recv.len(), "broadcast")?;
                let (a, pl) = self.choose(CollKind::Broadcast, dt, recv.len(), opts);
                if count == 0 {
                    return Ok(info(a, pl));
                }
                if a == Algo::ShmOneShot {
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    self.run_flat(coll, dt, recv.len(), 0, |f| {
                        shm::broadcast_shm(f, root, send, recv)
                    })?;
                    return Ok(info(a, pl));
                }
                let need = if a == Algo::Tree {
                    algo::tree_stage(&pl)
                } else {
                    64
                };
                self.run_exec(send, recv, dev, need, |ex| match a {
                    Algo::Tree => algo::broadcast_tree(ex, root, dt, count, &pl),
                    _ => algo::broadcast_ring(ex, root, dt, count, &pl),
                })?;
                Ok(info(a, pl))
            }
            Collective::Reduce { op, root } => {
                check_root(root)?;
                let input_len = send.map_or(recv.len(), |s| s.len());
                let count = elems("reduce input", input_len, dt)?;
                if me == root && recv.len() != input_len {
                    return Err(Error::arg(format!(
                        "reduce: the root's receive buffer has {} bytes but the input has {input_len}",
                        recv.len()
                    )));
                }
                let (a, pl) = self.choose(CollKind::Reduce, dt, input_len, opts);
                if count == 0 {
                    return Ok(info(a, pl));
                }
                if a == Algo::ShmOneShot {
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    self.run_flat(coll, dt, input_len, 0, |f| {
                        shm::reduce_shm(f, root, dt, op, send, recv)
                    })?;
                    return Ok(info(a, pl));
                }
                let need = if a == Algo::Tree {
                    algo::tree_stage(&pl)
                } else {
                    algo::chain_stage(&pl)
                };
                self.run_exec(send, recv, dev, need, |ex| match a {
                    Algo::Tree => algo::reduce_tree(ex, root, dt, op, count, &pl),
                    _ => algo::reduce_ring(ex, root, dt, op, count, &pl),
                })?;
                Ok(info(a, pl))
            }
            Collective::AllGather => {
                let total = elems("all_gather receive buffer", recv.len(), dt)?;
                let count = match send {
                    Some(s) => {
                        let c = elems("all_gather send buffer", s.len(), dt)?;
                        if c * n != total {
                            return Err(Error::arg(format!(
                                "all_gather: receive buffer holds {total} elements but {n} ranks × {c} are expected"
                            )));
                        }
                        c
                    }
                    None if total % n != 0 => {
                        return Err(Error::arg(format!(
                            "in-place all_gather: buffer of {total} elements is not divisible by {n} ranks"
                        )))
                    }
                    None => total / n,
                };
                let (a, pl) = self.choose(CollKind::AllGather, dt, recv.len(), opts);
                if count == 0 {
                    return Ok(info(a, pl));
                }
                if a == Algo::ShmOneShot {
                    let block = count * esz;
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    self.run_flat(coll, dt, block, 0, |f| {
                        shm::all_gather_shm(f, send, recv, block)
                    })?;
                    return Ok(info(a, pl));
                }
                self.run_exec(send, recv, dev, 64, |ex| {
                    algo::all_gather_ring(ex, dt, count, &pl)
                })?;
                Ok(info(a, pl))
            }
            Collective::ReduceScatter(op) => {
                let count = match send {
                    Some(s) => {
                        let c = elems("reduce_scatter receive buffer", recv.len(), dt)?;
                        let total = elems("reduce_scatter send buffer", s.len(), dt)?;
                        if c * n != total {
                            return Err(Error::arg(format!(
                                "reduce_scatter: send buffer holds {total} elements but {n} ranks × {c} are expected"
                            )));
                        }
                        c
                    }
                    None => {
                        let total = elems("reduce_scatter buffer", recv.len(), dt)?;
                        if total % n != 0 {
                            return Err(Error::arg(format!(
                                "in-place reduce_scatter: buffer of {total} elements is not divisible by {n} ranks"
                            )));
                        }
                        total / n
                    }
                };
                let (a, pl) = self.choose(CollKind::ReduceScatter, dt, count * n * esz, opts);
                if count == 0 {
                    return Ok(info(a, pl));
                }
                if a == Algo::ShmOneShot {
                    let block = count * esz;
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    self.run_flat(coll, dt, block, 0, |f| {
                        shm::reduce_scatter_shm(f, dt, op, send, recv, block)
                    })?;
                    return Ok(info(a, pl));
                }
                let need = algo::reduce_scatter_ring_stage(count, dt, &pl);
                self.run_exec(send, recv, dev, need, |ex| {
                    algo::reduce_scatter_ring(ex, dt, op, count, &pl)
                })?;
                Ok(info(a, pl))
            }
            Collective::AllToAll => {
                let total = elems("all_to_all receive buffer", recv.len(), dt)?;
                same_len(send, recv.len(), "all_to_all")?;
                if total % n != 0 {
                    return Err(Error::arg(format!(
                        "all_to_all: buffer of {total} elements is not divisible by {n} ranks"
                    )));
                }
                let (a, pl) = self.choose(CollKind::AllToAll, dt, recv.len(), opts);
                if total == 0 {
                    return Ok(info(a, pl));
                }
                let block = recv.len() / n;
                if a == Algo::ShmOneShot {
                    let (send, recv) = (host(send)?, recv.into_slice()?);
                    self.run_flat(coll, dt, block, 0, |f| {
                        shm::all_to_all_shm(f, send, recv, block)
                    })?;
                    return Ok(info(a, pl));
                }
                let need = if send.is_none() { recv.len() } else { 64 };
                self.run_exec(send, recv, dev, need, |ex| {
                    algo::all_to_all_pairwise(ex, block)
                })?;
                Ok(info(a, pl))
            }
            Collective::Barrier => {
                if self.node.is_some() {
                    self.run_flat(coll, dt, 0, 0, shm::barrier_shm)?;
                } else {
                    self.run_exec(
                        None,
                        MemMut::host(&mut []),
                        None,
                        64,
                        algo::barrier_dissemination,
                    )?;
                }
                Ok(CallInfo {
                    algo: None,
                    pipeline: None,
                })
            }
            Collective::SendRecv { to, from } => {
                for p in [to, from].into_iter().flatten() {
                    if p >= n {
                        return Err(Error::arg(format!(
                            "peer {p} is out of range for {n} ranks"
                        )));
                    }
                }
                let slen = send.map_or(0, |s| s.len());
                elems("send buffer", slen, dt)?;
                elems("receive buffer", recv.len(), dt)?;
                let rlen = recv.len();
                let src = send.unwrap_or(Mem::host(&[]));
                self.run_exec(Some(src), recv, dev, 64, |ex| {
                    algo::sendrecv(ex, to, slen, from, rlen)
                })?;
                Ok(CallInfo {
                    algo: None,
                    pipeline: None,
                })
            }
        }
    }

    /// Run a collective through the host's shared-memory segments (the model offers those
    /// algorithms only when they are mapped).
    fn run_flat(
        &mut self,
        coll: Collective,
        dt: DataType,
        bytes: usize,
        variant: u8,
        f: impl FnOnce(&mut shm::Flat) -> Result<()>,
    ) -> Result<()> {
        let (kind, op, root) = match coll {
            Collective::AllReduce(op) => (1, Some(op), None),
            Collective::Broadcast { root } => (2, None, Some(root)),
            Collective::Reduce { op, root } => (3, Some(op), Some(root)),
            Collective::AllGather => (4, None, None),
            Collective::ReduceScatter(op) => (5, Some(op), None),
            Collective::AllToAll => (6, None, None),
            Collective::Barrier | Collective::SendRecv { .. } => (7, None, None),
        };
        let code = crate::algo::shm::node::code(
            kind,
            dt as u8,
            op.map_or(0xff, |o| o as u8),
            variant,
            root,
        );
        let node = self.node.as_mut().ok_or_else(|| {
            Error::Internal("shared-memory algorithm chosen without segments".into())
        })?;
        let mut flat = shm::Flat {
            node,
            waiter: &self.cfg.waiter,
            abort: &self.links.abort,
            nranks: self.links.nranks,
            rank: self.links.rank,
            meta: [bytes as u64, code],
        };
        let r = f(&mut flat);
        flat.node.flush_wakes();
        r
    }

    fn run_exec(
        &mut self,
        send: Option<Mem<'_>>,
        recv: MemMut<'_>,
        dev: Option<&Arc<dyn Device>>,
        stage_bytes: usize,
        f: impl FnOnce(&mut Exec) -> Result<()>,
    ) -> Result<()> {
        self.stage(stage_bytes);
        let stage = &mut bytemuck::cast_slice_mut(&mut self.stage)[..stage_bytes];
        let mut ex = Exec::new(send, recv, stage, &mut self.links, &self.cfg.waiter, dev);
        ex.set_tag(self.call_tag);
        f(&mut ex)?;
        ex.device_done()
    }
}

/// Time limit helper for tests and tools: `ROCCL_TIMEOUT` as a duration.
pub fn timeout() -> Duration {
    crate::os::wait::timeout_from_env()
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Makes the worker thread fail to start when this thread submits a job.
        pub(super) static SPAWN_FAILS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A worker thread that cannot start takes no ticket: the non-blocking call fails
    /// alone, an enqueued job runs on the calling thread in its turn, and later calls run.
    #[test]
    fn a_worker_that_cannot_start_loses_no_turn() {
        let mut cfg = Config::from_env().unwrap();
        cfg.net = NetKind::Tcp;
        cfg.waiter.timeout = Duration::from_secs(20);
        let c = Arc::new(Communicator::init_with(&UniqueId::new().unwrap(), 1, 0, cfg).unwrap());
        SPAWN_FAILS.with(|f| f.set(true));
        let e = c
            .all_reduce_async(vec![1i32], RedOp::Sum)
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("worker thread"), "{e}");
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r2 = Arc::clone(&ran);
        c.enqueue(Box::new(move |t| {
            let mut x = [3u8];
            t.run_raw(
                Collective::AllReduce(RedOp::Sum),
                DataType::U8,
                None,
                &mut x,
                &CallOpts::default(),
            )
            .unwrap();
            r2.store(true, Ordering::SeqCst);
        }));
        assert!(
            ran.load(Ordering::SeqCst),
            "the job ran on the calling thread"
        );
        SPAWN_FAILS.with(|f| f.set(false));
        // The next turn is served: a blocking call on another thread returns.
        let (tx, rx) = mpsc::channel();
        let c2 = Arc::clone(&c);
        std::thread::spawn(move || {
            let mut x = [5i32];
            let _ = tx.send(c2.all_reduce_in_place(&mut x, RedOp::Sum).map(|_| x[0]));
        });
        let got = rx
            .recv_timeout(Duration::from_secs(15))
            .expect("the call after a failed worker start hung");
        assert_eq!(got.unwrap(), 5);
        assert_eq!(
            c.all_reduce_async(vec![2i32], RedOp::Sum).wait().unwrap(),
            [2]
        );
    }

    #[test]
    fn the_name_says_which_networks_carry_the_peers() {
        assert_eq!(combined_name("tcp", 0, 3), "tcp");
        assert_eq!(combined_name("tcp", 3, 0), "shm");
        assert_eq!(combined_name("tcp", 2, 4), "tcp+shm");
        assert_eq!(combined_name("verbs", 1, 1), "verbs+shm");
        assert_eq!(combined_name("rocev2", 1, 2), "rocev2+shm");
        assert_eq!(combined_name("tcp", 0, 0), "tcp");
    }
}
