//! The communicator: a group of ranks that run collectives together.
//!
//! Calls on one communicator run in the order they were issued, whether blocking (on the
//! calling thread) or non-blocking (on the communicator's worker thread): each call takes a
//! ticket when issued and runs when its turn comes. After an error the communicator is
//! unusable (its connections are closed) and every later call says why.

mod agree;
mod api;
mod blob;
mod call_tag;
mod calls;
mod config;
mod dispatch;
mod hier;
mod init;
mod measure;
mod queue;
mod reshape;
mod scratch;
pub mod settings;
pub mod stream;
mod tickets;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::algo::model::{self, CollKind, LinkCost};
use crate::algo::{Algo, Pipeline};
use crate::device::Device;
use crate::error::{AsyncError, Error, ErrorKind, Result};
use crate::exec::links::Links;
pub(crate) use crate::exec::{Mem, MemMut};
pub use crate::os::wait::Waiter;
use crate::types::DataType;
#[cfg(feature = "fuzzing")]
pub(crate) use agree::fuzz;
pub(crate) use api::P2pMem;
pub use api::{CallInfo, CallOpts, ClosedConnections, Collective, P2p};
#[cfg(feature = "fuzzing")]
pub(crate) use blob::fuzz_seed_blob;
pub use config::{Config, ConfigBuilder, CpuBind, GpuDirect, Hier, GPU_DIRECT_MIN, RING_WINDOW};
pub(crate) use measure::describe_steps;
pub use measure::{MeasuredLink, MeasuredLinks, NetChoice};
pub use queue::{Handle, Turn};

/// The end of every error about ranks in different calls.
const MISMATCH_TEXT: &str =
    ": every rank must make the same collective calls, with the same arguments, in the same order";

/// What [`Communicator::release_memory`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Cached GPU registrations released.
    pub registrations: usize,
    /// Bytes of scratch and idle staging buffers freed.
    pub bytes: usize,
}

/// What the cost model chose for a call.
type Choice = (Algo, Pipeline);

/// A call's shape and the algorithm and pipeline the model chose for it.
#[derive(Clone, Copy)]
struct LastChoice {
    kind: CollKind,
    dt: DataType,
    bytes: usize,
    /// The algorithm forced by the call or the settings, if any.
    forced: Option<Algo>,
    /// Whether the call could run by host.
    by_host: bool,
    choice: Choice,
}

struct State {
    links: Links,
    /// Every rank's shared-memory segment, when all ranks are on this host.
    node: Option<crate::algo::shm::node::Node>,
    /// Scaled inputs of averages of narrow floats (see `premultiplied`), kept from call
    /// to call up to `scratch::KEEP` bytes.
    premul: Vec<u8>,
    /// The tag of the call in progress (`call_tag::call_tag`, with its algorithm).
    call_tag: u32,
    /// The model's last answer, kept because calls repeat (one all-reduce per layer).
    last_choice: Option<LastChoice>,
    stage: Vec<u64>,
    /// The error that made the communicator unusable; shared with [`Shared::broken`] so that
    /// readers never wait for the call that holds the state.
    broken: Arc<Broken>,
    cfg: Config,
    cost: LinkCost,
    /// Hosts and ranks, when the job spans several hosts.
    topo: Option<Arc<crate::algo::topo::Topology>>,
    /// The links inside a host and between hosts (hierarchical calls), when it does.
    hier_cost: Option<(LinkCost, LinkCost)>,
    /// A reduce's host sum on a rank that gathers it for its host but is not the root.
    hier_scratch: Vec<u8>,
    /// The worker thread's spin time (see `worker_wait`).
    worker_spin: Duration,
    /// The waits' spin as fitted to the host at init, before the links measured stretched
    /// it (`Waiter::fit_latency` starts from it at each measurement).
    host_spin: Duration,
    /// The links between hosts as measured at init (`measure.rs`).
    measured: Option<MeasuredLinks>,
}

struct Shared {
    rank: usize,
    nranks: usize,
    /// Equal on every rank of this communicator, different for others
    /// ([`Communicator::id_hash`]).
    id_hash: u64,
    /// The job encrypts (its unique id says so): communicators split from it do too.
    encrypted: bool,
    net: &'static str,
    shm_segments: bool,
    /// Smallest message of a GPU-direct call ([`Config::gpu_direct_min`]).
    gpu_direct_min: usize,
    /// Integrated GPUs go GPU-direct too ([`GpuDirect::On`]).
    gpu_direct_integrated: bool,
    /// GPU-direct is on and the network takes GPU memory.
    gpu_direct_net: bool,
    /// Per peer, how GPU memory goes to it without staging (see `Links::device_mem`).
    device_mem: Vec<Option<bool>>,
    /// This rank's virtual clock on the simulated network (`ROCCL_NET=sim`).
    clock: Option<Arc<crate::net::sim::Clock>>,
    /// The state, and the calls on it in ticket order (non-blocking ones on the worker).
    calls: tickets::Tickets<State, Work>,
    /// Set once, read without a lock ([`Communicator::async_error`]).
    broken: Arc<Broken>,
    /// How the worker thread waits for its next job (see [`Communicator::worker`]).
    worker_wait: Waiter,
    /// Raised by `abort` without the state lock, so a blocked call sees it.
    abort: Arc<std::sync::atomic::AtomicBool>,
    /// What shrink and grow need (`reshape`).
    reshape: reshape::Reshape,
}

/// Work for the worker thread, as it runs in a turn.
type Work = Box<dyn FnOnce(&mut State) + Send>;

/// The error that made a communicator unusable: set once (the first error wins), read
/// without waiting by any thread.
#[derive(Default)]
struct Broken(std::sync::OnceLock<AsyncError>);

impl Broken {
    fn get(&self) -> Option<&AsyncError> {
        self.0.get()
    }
    /// Record `e` unless an earlier error is recorded; true if this one was.
    fn set(&self, e: AsyncError) -> bool {
        self.0.set(e).is_ok()
    }
    /// The error later calls get.
    fn error(&self) -> Option<Error> {
        self.get().map(|b| {
            Error::InvalidUsage(format!(
                "communicator is unusable after an earlier error: {b}"
            ))
        })
    }
}

/// A group of ranks that run collectives together.
pub struct Communicator {
    shared: Arc<Shared>,
}

impl Communicator {
    /// A 64-bit value equal on every rank of this communicator and different for other
    /// communicators (from the unique id's root address and nonce, not its secret): what
    /// NCCL calls the communicator's hash.
    pub fn id_hash(&self) -> u64 {
        self.shared.id_hash
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

    /// On the simulated network (`ROCCL_NET=sim`): the time this rank's last call took in
    /// virtual time, as the link model predicts it (from its start to its end on this rank;
    /// a collective's predicted time is the largest over its ranks). `None` on real
    /// networks.
    pub fn predicted_time(&self) -> Option<std::time::Duration> {
        self.shared.clock.as_ref().map(|c| c.last_call())
    }

    /// On the simulated network: this rank's virtual clock now. `None` on real networks.
    pub fn virtual_clock(&self) -> Option<std::time::Duration> {
        self.shared.clock.as_ref().map(|c| c.now())
    }

    /// On the simulated network: set this rank's virtual clock, e.g. every rank to the
    /// latest of their clocks before timing calls (what a barrier does on a real cluster).
    /// Only between calls. False (and nothing done) on real networks.
    pub fn set_virtual_clock(&self, t: std::time::Duration) -> bool {
        match &self.shared.clock {
            Some(c) => {
                c.set(t);
                true
            }
            None => false,
        }
    }

    /// Whether the shared-memory collectives (`shm1`, `shm2`) are available: every rank is
    /// on this host and all of them mapped each other's segments.
    pub fn shm_collectives(&self) -> bool {
        self.shared.shm_segments
    }

    /// The error that made this communicator unusable, if any: its class, the peer it
    /// blames and why, and its message. Never waits: a call in progress on another thread
    /// does not hold it.
    pub fn async_error(&self) -> Option<AsyncError> {
        self.shared.broken.get().cloned()
    }

    /// Close all connections now; pending and later calls fail.
    ///
    /// Safe to call from any thread while another thread is blocked in a collective on this
    /// communicator: the blocked call notices within one wait pass (at most ~20 ms when
    /// sleeping) and returns an error; then the connections are closed.
    pub fn abort(&self) {
        self.abort_with("communicator aborted by the application");
    }

    /// Each network's own counters, by network (RoCE v2: packets, retransmissions, NAKs,
    /// ICRC errors...), as the metrics endpoint shows them. Runs in turn, after the calls
    /// issued before it.
    pub fn net_counters(&self) -> Vec<(&'static str, Vec<(&'static str, u64)>)> {
        self.with_turn(|state| {
            let eps = &state.links.endpoints;
            eps.iter()
                .map(|e| {
                    let mut v = Vec::new();
                    e.net.counters(&mut v);
                    (e.net.name(), v)
                })
                .collect()
        })
    }

    /// Give back what this communicator holds for speed and can make again when needed
    /// (NCCL's `ncclCommSuspend` with `NCCL_SUSPEND_MEM`): its cached GPU registrations
    /// (which keep the GPU memory they name allocated and pinned, even after the program
    /// frees it), its scratch buffers, and the process's idle staging buffers. Runs in
    /// turn, after the calls issued before it. Connections stay open: closing one needs
    /// its peer's agreement ([`Communicator::close_idle_connections`]).
    pub fn release_memory(&self) -> Released {
        let mut out = self.with_turn(|state| {
            let mut out = Released::default();
            let mut i = 0;
            while i < state.links.gpu.cache.len() {
                if state.links.drop_cached(i) {
                    out.registrations += 1;
                } else {
                    i += 1;
                }
            }
            out.bytes = state.premul.capacity() + 8 * state.stage.capacity();
            state.premul = Vec::new();
            state.stage = Vec::new();
            out
        });
        out.bytes += stream::release_idle_staging();
        crate::os::mem::trim_heap();
        out
    }

    /// [`Communicator::abort`], leaving `why` as the communicator's error.
    fn abort_with(&self, why: &str) {
        self.shared.abort.store(true, Ordering::SeqCst);
        self.shared
            .broken
            .set(AsyncError::new(ErrorKind::InvalidUsage, why));
        let mut state = self.shared.calls.lock();
        if let Some(node) = &state.node {
            node.mark_broken();
        }
        state.links.close_all();
    }

    /// Algorithm and pipeline the cost model picks for a collective of `bytes` bytes.
    pub fn plan(
        &self,
        kind: CollKind,
        dt: DataType,
        bytes: usize,
        algo: Option<Algo>,
    ) -> (Algo, Pipeline) {
        let state = self.shared.calls.lock();
        model::choose_for(
            kind,
            dt,
            self.shared.nranks,
            bytes,
            &state.cost,
            algo.or(state.cfg.algo),
            &state.cfg.tuning,
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
            && !self.shared.shm_segments
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
        opts: &CallOpts,
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<CallInfo> {
        self.with_turn(|state| state.execute_mem(coll, dt, send, recv, opts, dev))
    }

    /// [`Communicator::p2p`] on buffers that may be GPU memory.
    pub(crate) fn p2p_mem(
        &self,
        ops: &mut [P2pMem<'_>],
        dev: Option<&Arc<dyn Device>>,
    ) -> Result<()> {
        self.with_turn(|state| state.p2p_mem(ops, dev))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Stop the worker after the jobs already queued.
        self.shared.calls.close();
    }
}

/// Time limit helper for tests and tools: `ROCCL_TIMEOUT` as a duration.
pub use crate::envvar::timeout;

#[cfg(test)]
mod tests {
    use super::init::combined_name;
    use super::*;
    use crate::bootstrap::UniqueId;
    use crate::net::NetKind;
    use crate::types::RedOp;

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
        let (tx, rx) = std::sync::mpsc::channel();
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

    /// The scratch of averages of narrow floats keeps at most `scratch::KEEP` bytes
    /// after a large average (16 MiB of f16 here), and a small one reuses what it keeps (no
    /// allocation per call); the results stay right.
    #[test]
    fn a_large_average_leaves_no_large_scratch_behind() {
        use half::f16;
        let id = UniqueId::new().unwrap();
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let mut cfg = Config::from_env().unwrap();
                    cfg.net = NetKind::Tcp;
                    cfg.waiter.timeout = Duration::from_secs(30);
                    let c = Communicator::init_with(&id, 2, r, cfg).unwrap();
                    let kept = || c.shared.calls.lock().premul.capacity();
                    // Rank r sends (r + 1) × (i % 64): the average is 1.5 × (i % 64), exact.
                    let input = |n: usize| -> Vec<f16> {
                        (0..n)
                            .map(|i| f16::from_f32(((r + 1) * (i % 64)) as f32))
                            .collect()
                    };
                    let check = |got: &[f16], offset: usize| {
                        for (k, g) in got.iter().enumerate() {
                            let want = 1.5 * ((offset + k) % 64) as f32;
                            assert_eq!(g.to_f32(), want, "rank {r}, element {}", offset + k);
                        }
                    };
                    let big = 8 << 20; // elements: 16 MiB of input
                    let mut out = vec![f16::ZERO; big / 2];
                    c.reduce_scatter(&input(big), &mut out, RedOp::Avg).unwrap();
                    check(&out, r * big / 2);
                    let after_big = kept();
                    let small = 512;
                    let mut out = vec![f16::ZERO; small / 2];
                    c.reduce_scatter(&input(small), &mut out, RedOp::Avg)
                        .unwrap();
                    check(&out, r * small / 2);
                    let at = c.shared.calls.lock().premul.as_ptr();
                    c.reduce_scatter(&input(small), &mut out, RedOp::Avg)
                        .unwrap();
                    check(&out, r * small / 2);
                    let again = c.shared.calls.lock().premul.as_ptr();
                    (after_big, kept(), at == again)
                })
            })
            .collect();
        for (r, t) in ranks.into_iter().enumerate() {
            let (after_big, after_small, reused) = t.join().unwrap();
            assert!(
                after_big <= scratch::KEEP,
                "rank {r} kept {after_big} bytes of scratch after a 16 MiB average"
            );
            assert!(
                after_small >= 1024,
                "rank {r} kept no scratch for small averages"
            );
            assert!(
                reused,
                "rank {r} allocated again for a second small average"
            );
        }
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
