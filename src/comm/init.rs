//! Communicator creation: joining the ranks through the bootstrap, agreeing on the
//! settings and network (`agree`), listening, the shared-memory segments; and splitting.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::algo::model::LinkCost;
use crate::bootstrap::{self, env::Root, UniqueId};
use crate::error::{Error, Result};
use crate::exec::links::{
    Endpoint, LinkSettings, Links, MAX_LANES, TIMEOUT_GRACE_MAX, TIMEOUT_GRACE_MIN,
};
use crate::net::{self, NetHandle, NetKind};
use crate::os::wait::Waiter;

use super::config::EXTRA_NETS;
use super::tickets::Tickets;
use super::{agree, blob, stream, Broken, Communicator, Config, CpuBind, GpuDirect, Shared, State};

/// The name a communicator reports: its network, or shared memory when every peer is on this
/// host, or both.
pub(super) fn combined_name(
    net: &'static str,
    shm_peers: usize,
    other_peers: usize,
) -> &'static str {
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
    /// waits of initialization (the rendezvous, the shared-memory attach, the connections
    /// of `ROCCL_CONNECT=all`) return an error within about 100 ms (what `rocclCommAbort`
    /// does to a non-blocking init).
    pub fn init_abortable(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
        abort: &std::sync::atomic::AtomicBool,
    ) -> Result<Communicator> {
        check_rank(rank, nranks)?;
        let (root, nonce) = id.root()?;
        let local = bootstrap::ifaces::local_addr(Some(root.ip()))?;
        let net = open_network(id, rank, &cfg, cfg.net, local)?;
        let extras = open_extras(id, rank, &cfg, local);
        let net_gpu = gpu_direct_over(&*net, &cfg, &extras)?;
        let (handle, listen) = net.listen(0)?;
        // With `auto`, ranks of one host also get a shared-memory endpoint (ROCCL_SHM=0: no).
        // A network named explicitly (tcp, rocev2, verbs) carries every peer when the job is
        // on one host (its tests and benchmarks), but on a job of several hosts it is the
        // network between hosts, and ranks of one host use shared memory as under `auto`:
        // the endpoint is made for it too and dropped after the rendezvous on one host.
        let shm_between_hosts = !matches!(cfg.net, NetKind::Auto | NetKind::Shm | NetKind::Sim);
        let shm = shm_endpoint(&cfg, shm_between_hosts, id, &*net);
        // Segments for collectives through shared memory, created before the rendezvous so
        // that peers on this host can map them once it is over.
        let tag = nonce ^ ((nranks as u64) << 48);
        let node_seg = node_segment(&cfg, shm.is_some(), tag, rank, nranks);
        let props = net.properties(0)?;
        let mine = blob::settings(&cfg, stream::ops::stream_chunk()?);
        // A listener for later rendezvous without a new unique id (shrink, grow).
        let spare = bootstrap::spare::SpareRoot::bind(local)
            .inspect_err(|e| {
                crate::info!("rank {rank}: no spare rendezvous listener ({e}): shrink and grow will be refused")
            })
            .ok();
        let handles = (&handle, shm.as_ref().map(|s| &s.1));
        let extra_handles = extra_handles(&extras);
        let own = own_blob(
            &cfg,
            rank,
            (&*net, &props),
            handles,
            node_seg.is_some(),
            &mine,
            (&spare, &extra_handles),
        )?;
        let table =
            bootstrap::rendezvous_abortable(id, rank, nranks, &own, cfg.waiter.timeout, abort)
                .inspect_err(|_| {
                    if node_seg.is_some() {
                        // A rank killed meanwhile cannot unlink its own segment.
                        crate::algo::shm::node::remove_dead_segments(tag, rank, nranks);
                    }
                })?;
        let (blobs, shm) = table_blobs(&table, rank, (net.name(), &mine), shm, shm_between_hosts)?;
        let given = cfg.clone();
        let place = Placement::of(&blobs, rank, shm.is_some());
        if cfg.net != NetKind::Sim {
            bind_thread(cfg.cpu_bind, &place, rank);
        }
        let mut cfg = cfg;
        cfg.waiter.fit(place.local_ranks, place.cores);
        // Large messages take a channel per NIC of the fewest any rank has (the same on
        // every rank: the channels decide how a call is cut).
        cfg.tuning.nics = agree::nics_per_rank(&blobs);
        // Every rank on this host with its segment: map them all (every rank decides alike).
        let node = match node_seg {
            Some(own) if place.local_ranks == nranks && blobs.iter().all(|b| b.node) => {
                crate::algo::shm::node::Node::attach(own, tag, rank, nranks, &cfg.waiter, abort)?
            }
            _ => None,
        };
        let (cost, topo, hier_cost) = cost_and_topology(&blobs, &cfg, rank, &*net, node.as_ref());
        let name = combined_name(net.name(), place.shm_peers, place.other_peers());
        log_setup(
            rank,
            &cfg,
            (&*net, &props, local),
            name,
            &place,
            (&cost, node.as_ref()),
            &blobs,
        );
        let (endpoints, my_lanes) = endpoints(net, listen, shm, extras, place.local_index);
        let id_hash = id_hash(id);
        let metrics = comm_metrics(
            (rank, nranks, id_hash),
            (name, cfg.trace.as_deref()),
            &endpoints,
            node.as_ref(),
        );
        let links = make_links(
            rank,
            &cfg,
            (nonce, endpoints, my_lanes),
            &place,
            &blobs,
            (net_gpu, metrics),
        );
        if let Some(Err(e)) = crate::metrics::http::start_at(cfg.metrics_addr.as_deref()) {
            crate::warn!("{e}: no metrics endpoint");
        }
        let connect_all = cfg.connect_all;
        let measure = cfg.measure_links && cfg.net != NetKind::Sim;
        let parts = Parts {
            id_hash,
            name,
            net_gpu,
            node,
            cost,
            topo,
            hier_cost,
            spares: blobs.iter().map(|b| b.spare).collect(),
            spare,
            given,
            worker_wait: worker_wait(&cfg, &place),
        };
        let comm = Communicator::assemble(id, rank, nranks, cfg, links, parts);
        comm.after_init(abort, connect_all, measure)?;
        Ok(comm)
    }

    /// The communicator of the parts made by [`Communicator::init_abortable`].
    fn assemble(
        id: &UniqueId,
        rank: usize,
        nranks: usize,
        cfg: Config,
        links: Links,
        p: Parts,
    ) -> Communicator {
        let abort_flag = Arc::clone(&links.blame.abort);
        let clock = links.clock.clone();
        let device_mem = links.gpu.device_mem.clone();
        let broken = Arc::new(Broken::default());
        Communicator {
            shared: Arc::new(Shared {
                rank,
                nranks,
                id_hash: p.id_hash,
                encrypted: id.encrypted(),
                net: p.name,
                shm_segments: p.node.is_some(),
                gpu_direct_min: cfg.gpu_direct_min,
                gpu_direct_integrated: cfg.gpu_direct == GpuDirect::On,
                gpu_direct_net: p.net_gpu.is_some(),
                device_mem,
                clock,
                calls: Tickets::new(
                    State {
                        links,
                        node: p.node,
                        premul: Vec::new(),
                        call_tag: 0,
                        last_choice: None,
                        stage: Vec::new(),
                        broken: Arc::clone(&broken),
                        cost: p.cost,
                        topo: p.topo,
                        hier_cost: p.hier_cost,
                        hier_scratch: Vec::new(),
                        worker_spin: p.worker_wait.spin,
                        host_spin: cfg.waiter.spin,
                        measured: None,
                        cfg,
                    },
                    State::panicked,
                ),
                broken,
                worker_wait: p.worker_wait,
                abort: abort_flag,
                reshape: super::reshape::Reshape {
                    spare: p.spare,
                    spares: p.spares,
                    key: id.job_key(),
                    cfg: p.given,
                    count: AtomicU64::new(0),
                    revoked: std::sync::atomic::AtomicBool::new(false),
                },
            }),
        }
    }

    /// What an init does on the communicator once it is made, as `cfg` asked: open every
    /// connection (`ROCCL_CONNECT=all`), measure the links between hosts (`ROCCL_MEASURE`).
    fn after_init(
        &self,
        abort: &std::sync::atomic::AtomicBool,
        connect_all: bool,
        measure: bool,
    ) -> Result<()> {
        if !(connect_all || measure) {
            return Ok(());
        }
        self.abortable(abort, |c| {
            if connect_all {
                c.connect_all()?;
            }
            if measure {
                c.measure_links()?;
            }
            Ok(())
        })
    }

    /// `f` (what an abortable init does on the communicator once it is made: the connect
    /// phase of `ROCCL_CONNECT=all`, the measurement of the links between hosts) with its
    /// waits watching the communicator's own abort flag, which a watcher raises within about
    /// 10 ms of `abort` (the init's flag, another thread's `rocclCommAbort`): it ends on abort
    /// like the rendezvous before it does.
    fn abortable(
        &self,
        abort: &std::sync::atomic::AtomicBool,
        f: impl FnOnce(&Self) -> Result<()>,
    ) -> Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let watch = std::thread::Builder::new()
                .name("roccl-init-abort".into())
                .spawn_scoped(s, || {
                    while !done.load(Ordering::Relaxed) {
                        if abort.load(Ordering::Relaxed) {
                            self.shared.abort.store(true, Ordering::Relaxed);
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                });
            if let Err(e) = watch {
                crate::info!(
                    "rank {}: no thread to watch for an abort while connecting or measuring the links ({e}): an abort ends this init only at ROCCL_TIMEOUT",
                    self.rank()
                );
            }
            let r = f(self);
            done.store(true, Ordering::Relaxed);
            r
        })
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
                // `ROCCL_ROOT=a,b,c:port`: the root's address on each subnet (a switchless
                // mesh); each rank connects to the one its host reaches.
                let mut hosts = host.split(',').map(str::trim);
                let addr = resolve(hosts.next().unwrap_or_default(), *port)?;
                let others = hosts
                    .map(|h| match resolve(h, *port)?.ip() {
                        std::net::IpAddr::V4(v) => Ok(v),
                        std::net::IpAddr::V6(v) => Err(Error::arg(format!(
                            "ROCCL_ROOT: {v} in a list of root addresses: a list takes IPv4 addresses only (give one IPv6 address alone)"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let secret = bootstrap::env::job_secret(addr)?;
                if secret.is_none() && bootstrap::seal::requested() && !bootstrap::seal::has_psk() {
                    return Err(bootstrap::keyless_encryption(info.rank));
                }
                if secret.is_none() {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        crate::warn!(
                            "no ROCCL_JOB_SECRET / ROCCL_JOB_SECRET_FILE: the ranks of this job are authenticated by the root's address and port only ({addr}), as with NCCL; anyone who can reach that port can join the job. Give every rank the same secret (e.g. ROCCL_JOB_SECRET=$(openssl rand -hex 16) exported before launching) to refuse strangers"
                        )
                    });
                }
                if info.rank == 0 {
                    bootstrap::serve_root_on(addr, &others, secret)?
                } else {
                    UniqueId::for_address_with(addr, secret).with_other_roots(&others)?
                }
            }
        };
        Self::init_with(&id, info.nranks, info.rank, cfg)
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
        // The first member of each group binds the new root and everyone learns its address
        // and a random nonce; each member derives the id's secret from this communicator's
        // key (as shrink and grow do), so no secret travels over the data path.
        let mut public = [0u8; 32];
        let mut root = None;
        let mut created = Ok(());
        if group.first() == Some(&me) {
            let bound = crate::bootstrap::ifaces::local_addr(None)
                .and_then(crate::bootstrap::spare::SpareRoot::bind)
                .and_then(|r| Ok((crate::bootstrap::auth::random::<8>()?, r)));
            match bound {
                Ok((nonce, r)) => {
                    public[..24]
                        .copy_from_slice(&crate::bootstrap::spare::encode_addr(Some(r.addr())));
                    public[24..].copy_from_slice(&nonce);
                    root = Some(r);
                }
                Err(e) => created = Err(e),
            }
        }
        let mut all_public = vec![0u8; n * public.len()];
        self.all_gather(&public, &mut all_public)?;
        created?;
        let Some(&leader) = group.first() else {
            return Ok(None);
        };
        let theirs = &all_public[leader * public.len()..(leader + 1) * public.len()];
        let at =
            crate::bootstrap::spare::decode_addr(&theirs[..24]).ok_or_else(|| Error::Remote {
                rank: leader,
                cause: crate::error::PeerCause::Failed,
                msg: format!("rank {leader} could not create the root of the split communicator"),
            })?;
        let label = [b"roccl split v1 ", theirs].concat();
        let uid = crate::bootstrap::spare::derived_id(
            at,
            &self.shared.reshape.key,
            &label,
            self.shared.encrypted,
        );
        if let Some(r) = root {
            r.serve(uid)?;
        }
        let cfg = self.shared.calls.lock().cfg.clone();
        let pos = group
            .iter()
            .position(|&r| r == me)
            .expect("member of own group");
        Communicator::init_with(&uid, group.len(), pos, cfg).map(Some)
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::sys(format!("resolving the root host '{host}'"), e))?;
    addrs
        .next()
        .ok_or_else(|| Error::arg(format!("root host '{host}' has no address")))
}

/// `rank` of `nranks` makes sense.
fn check_rank(rank: usize, nranks: usize) -> Result<()> {
    if nranks == 0 {
        return Err(Error::arg("nranks must be at least 1"));
    }
    if rank >= nranks {
        return Err(Error::arg(format!(
            "rank {rank} is out of range for {nranks} ranks (ranks are 0..{})",
            nranks - 1
        )));
    }
    Ok(())
}

/// What [`Communicator::init_abortable`] hands [`Communicator::assemble`] besides the links.
struct Parts {
    id_hash: u64,
    /// The name the communicator reports ([`combined_name`]).
    name: &'static str,
    /// Whether GPU memory goes to peers over the network (and as dmabufs).
    net_gpu: Option<bool>,
    node: Option<crate::algo::shm::node::Node>,
    cost: LinkCost,
    topo: Option<Arc<crate::algo::topo::Topology>>,
    hier_cost: Option<(LinkCost, LinkCost)>,
    spare: Option<bootstrap::spare::SpareRoot>,
    spares: Vec<Option<SocketAddr>>,
    /// The settings as given (before they were fitted to the host), for shrink and grow.
    given: Config,
    worker_wait: Waiter,
}

/// Where this rank sits among the ranks of the table: its host, its peers on it and how
/// each peer is reached.
struct Placement {
    my_host: u64,
    local_ranks: usize,
    /// This rank's index among the ranks of its host.
    local_index: usize,
    cores: usize,
    /// Per peer: 1 when reached through shared memory, else 0 (the network).
    peer_net: Vec<usize>,
    shm_peers: usize,
    nranks: usize,
    /// Every rank of this host runs in a process of its own (not several as threads of one).
    own_processes: bool,
}

impl Placement {
    /// The placement of `rank` in `blobs`; `shm`: whether this rank has a shared-memory
    /// endpoint (peers on this host that offer one too are reached through it).
    fn of(blobs: &[blob::Blob], rank: usize, shm: bool) -> Placement {
        let my_host = blobs[rank].host;
        let peer_net: Vec<usize> = blobs
            .iter()
            .map(|b| usize::from(shm && b.host == my_host && b.shm.is_some()))
            .collect();
        let shm_peers = (0..blobs.len())
            .filter(|&p| p != rank && peer_net[p] == 1)
            .count();
        Placement {
            my_host,
            local_ranks: blobs.iter().filter(|b| b.host == my_host).count(),
            local_index: blobs[..rank].iter().filter(|b| b.host == my_host).count(),
            cores: crate::os::host_cores(),
            peer_net,
            shm_peers,
            nranks: blobs.len(),
            own_processes: {
                let mut procs: Vec<_> = blobs
                    .iter()
                    .filter(|b| b.host == my_host)
                    .map(|b| (b.pid_ns, b.pid))
                    .collect();
                let all = procs.len();
                procs.sort_unstable();
                procs.dedup();
                procs.len() == all
            },
        }
    }

    /// Peers reached over the network.
    fn other_peers(&self) -> usize {
        self.nranks - 1 - self.shm_peers
    }
}

thread_local! {
    /// An earlier communicator's init on this thread decided its CPU binding.
    static BIND_DECIDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Bind the calling thread to one CPU as [`Config::cpu_bind`] says: the first
/// communicator a thread creates decides (torch creates the world's first, then subgroups
/// whose ranks would number the host's differently). `auto` binds only ranks that are
/// processes of their own: ranks run as threads of one process (tests) are left to their
/// program. A thread that may already run on one CPU only (bound by its launcher, or by
/// `roccl-perf --bind auto`) is left alone; a failure only costs speed, so it is said and
/// the init goes on.
fn bind_thread(bind: CpuBind, place: &Placement, rank: usize) {
    if bind == CpuBind::Off || BIND_DECIDED.with(|d| d.replace(true)) {
        return;
    }
    if bind == CpuBind::Auto && (place.local_ranks <= place.cores || !place.own_processes) {
        return;
    }
    let cpus = match crate::os::allowed_cpus() {
        Ok(cpus) if cpus.len() > 1 => cpus,
        _ => return,
    };
    let cpu = cpus[place.local_index * cpus.len() / place.local_ranks.max(1)];
    match crate::os::bind_to_cpu(cpu) {
        Ok(()) => crate::info!(
            "rank {rank}: {} ranks on this host's {} cores: this thread now runs on CPU {cpu} \
             only (ROCCL_CPU_BIND=0 leaves it free)",
            place.local_ranks,
            place.cores
        ),
        Err(e) => crate::info!("rank {rank}: not bound to CPU {cpu} ({e}); it runs unbound"),
    }
}

/// The network of `cfg` for `rank`, told this communicator's deadline and job key, with the
/// encryption the id asks for (refused where it cannot be had).
fn open_network(
    id: &UniqueId,
    rank: usize,
    cfg: &Config,
    kind: NetKind,
    local: std::net::IpAddr,
) -> Result<Arc<dyn net::Net>> {
    // The simulated network places its rank on a host of its cluster: it is made here,
    // where the rank is known.
    let net: Arc<dyn net::Net> = if kind == NetKind::Sim {
        Arc::new(net::sim::SimNet::new(rank, cfg.sim.clone())?)
    } else {
        net::open(kind, local, &cfg.network)?
    };
    // The network's own waits (retransmission, draining at close) end at this
    // communicator's deadline, not at one read from the environment.
    net.set_timeout(cfg.waiter.timeout);
    // Connections prove that they belong to this job (docs/SECURITY.md).
    net.set_job_key(&id.job_key());
    if crate::bootstrap::seal::requested() && !id.encrypted() {
        return Err(Error::InvalidUsage(format!(
            "rank {rank}: ROCCL_ENCRYPT=1 (or ncclSetEncryption) here, but the unique id was made without encryption: ask for it where the id is made (rank 0, before rocclGetUniqueId / ncclGetUniqueId), or on every rank in launcher mode"
        )));
    }
    if id.encrypted() && !id.has_secret() && !crate::bootstrap::seal::has_psk() {
        return Err(bootstrap::keyless_encryption(rank));
    }
    net.set_encryption(id.encrypted());
    if id.encrypted() && !net.encrypts() && !matches!(cfg.net, NetKind::Shm | NetKind::Sim) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            crate::warn!(
                "ROCCL_ENCRYPT: the bootstrap is encrypted, but data over {} is not (RDMA cannot be encrypted in software without losing zero copy; shared memory stays on the host): use ROCCL_NET=tcp to encrypt the data too, or IPsec/MACsec below roccl (docs/SECURITY.md)",
                net.name()
            )
        });
    }
    Ok(net)
}

/// A network offered beside the main one (`ROCCL_NETS`), listening.
struct Extra {
    /// Its lane: 1 + its place in [`EXTRA_NETS`].
    lane: usize,
    net: Arc<dyn net::Net>,
    handle: NetHandle,
    listen: Box<dyn net::ListenComm>,
}

/// The networks of [`Config::extra_nets`] this rank can open; one it cannot is left out (its
/// peers then reach it over the others) and said at INFO.
fn open_extras(id: &UniqueId, rank: usize, cfg: &Config, local: std::net::IpAddr) -> Vec<Extra> {
    let mut out: Vec<Extra> = Vec::new();
    if !cfg.measure_links && !cfg.extra_nets.is_empty() {
        crate::warn!(
            "rank {rank}: ROCCL_NETS lists networks beside the first, but ROCCL_MEASURE=0: without measurements nothing can choose them, so every call takes the first (unset ROCCL_MEASURE to choose)"
        );
        return out;
    }
    for &kind in &cfg.extra_nets {
        // Listed twice, the main network again, or one that cannot run between hosts (a
        // list set in code, which `ROCCL_NETS`' parser would have refused): left out.
        let Some(i) = EXTRA_NETS.iter().position(|&k| k == kind) else {
            continue;
        };
        if kind == cfg.net || out.iter().any(|x| x.lane == i + 1) {
            continue;
        }
        let opened = open_network(id, rank, cfg, kind, local).and_then(|net| {
            let (handle, listen) = net.listen(0)?;
            Ok(Extra {
                lane: i + 1,
                net,
                handle,
                listen,
            })
        });
        match opened {
            Ok(x) => out.push(x),
            Err(e) => crate::info!(
                "rank {rank}: ROCCL_NETS lists {}, which this rank cannot open ({e}): its peers reach it over the other networks",
                kind.name()
            ),
        }
    }
    // In lane order: the endpoints and the peers' handles follow it (`make_links`).
    out.sort_by_key(|x| x.lane);
    out
}

/// This rank's handles on the networks it offers beside the main one, by lane.
fn extra_handles(extras: &[Extra]) -> [Option<NetHandle>; EXTRA_NETS.len()] {
    let mut out: [Option<NetHandle>; EXTRA_NETS.len()] = Default::default();
    for x in extras {
        out[x.lane - 1] = Some(x.handle.clone());
    }
    out
}

/// Whether GPU memory can go to peers over `net` (`Some(dmabuf)`), as `cfg` asks: also over
/// each of the `extras` (`ROCCL_NETS`) alike, since a call may take any of them.
/// Connections keep eager messages: the executor hands the network a GPU copy for those.
fn gpu_direct_over(net: &dyn net::Net, cfg: &Config, extras: &[Extra]) -> Result<Option<bool>> {
    if cfg.gpu_direct == GpuDirect::Off {
        return Ok(None);
    }
    let p = net.properties(0)?.ptr_support;
    if p.dmabuf || p.device {
        for x in extras {
            let q = x.net.properties(0)?.ptr_support;
            if !(q.dmabuf || q.device) || q.dmabuf != p.dmabuf {
                crate::info!(
                    "GPU-direct (ROCCL_GPU_DIRECT) is off: ROCCL_NETS lists {}, which cannot take GPU memory as {} does, and a call may take either: GPU buffers are staged through host memory",
                    x.net.name(),
                    net.name()
                );
                return Ok(None);
            }
        }
        return Ok(Some(p.dmabuf));
    }
    crate::info!(
        "GPU-direct (ROCCL_GPU_DIRECT) is not possible: {} cannot take GPU memory (it needs an RDMA NIC with dmabuf or peer-memory support): GPU buffers are staged through host memory",
        net.name()
    );
    Ok(None)
}

/// A shared-memory network endpoint (network, handle, listener) for peers on this host,
/// where `cfg` wants one and this host offers it.
type ShmEndpoint = (Arc<dyn net::Net>, NetHandle, Box<dyn net::ListenComm>);

/// The shared-memory endpoint of a rank whose network is `net` (see `init_abortable`).
fn shm_endpoint(
    cfg: &Config,
    between_hosts: bool,
    id: &UniqueId,
    net: &dyn net::Net,
) -> Option<ShmEndpoint> {
    if !(cfg.net == NetKind::Auto || between_hosts) || !cfg.shm {
        return None;
    }
    let made = net::shm::ShmNet::new(&cfg.network.shm).and_then(|n| {
        net::Net::set_job_key(&n, &id.job_key());
        let (h, l) = net::Net::listen(&n, 0)?;
        Ok((Arc::new(n) as Arc<dyn net::Net>, h, l))
    });
    made.inspect_err(|e| {
        crate::info!(
            "shared memory unavailable ({e}): peers on this host use {}",
            net.name()
        )
    })
    .ok()
}

/// This rank's segment for collectives through shared memory, where they can run.
fn node_segment(
    cfg: &Config,
    shm: bool,
    tag: u64,
    rank: usize,
    nranks: usize,
) -> Option<crate::algo::shm::node::NodeSeg> {
    if nranks < 2 || !((shm && cfg.net == NetKind::Auto) || cfg.net == NetKind::Shm) {
        return None;
    }
    let slot = cfg.shm_slot.unwrap_or(crate::algo::shm::node::DEFAULT_SLOT);
    crate::algo::shm::node::NodeSeg::create(tag, rank, slot)
        .inspect_err(|e| crate::info!("shared-memory collectives unavailable on rank {rank}: {e}"))
        .ok()
}

/// The blob this rank registers at the rendezvous (`blob::blob`): its listen handles
/// (network, shared memory), settings, host and spare rendezvous address.
fn own_blob(
    cfg: &Config,
    rank: usize,
    (net, props): (&dyn net::Net, &net::NetProperties),
    (handle, shm): (&NetHandle, Option<&NetHandle>),
    node: bool,
    mine: &[u64; blob::SETTINGS.len()],
    (spare, extras): (
        &Option<bootstrap::spare::SpareRoot>,
        &[Option<NetHandle>; EXTRA_NETS.len()],
    ),
) -> Result<Vec<u8>> {
    Ok(blob::blob(
        handle,
        net.name(),
        shm,
        node,
        mine,
        (
            blob::HostInputs {
                cores: crate::os::host_cores() as u32,
                latency_us: props.latency_us,
                speed_mbps: props.speed_mbps,
                nic: blob::nic_fingerprint(props),
                devices: net.devices() as u32,
            },
            crate::algo::calibrate::host_speeds(cfg.calibrate),
        ),
        (spare.as_ref().map(|s| s.addr()), extras),
        host_of(cfg, rank)?,
    ))
}

/// The rendezvous table's blobs, checked against this rank's settings; on a job of one
/// host whose network was named (`shm_between_hosts`) and where no rank offers networks to
/// choose among (`ROCCL_NETS`), without the shared-memory endpoints (every rank sees the
/// same table, so all drop them alike).
fn table_blobs(
    table: &[Vec<u8>],
    rank: usize,
    (net, mine): (&str, &[u64; blob::SETTINGS.len()]),
    shm: Option<ShmEndpoint>,
    shm_between_hosts: bool,
) -> Result<(Vec<blob::Blob>, Option<ShmEndpoint>)> {
    let mut blobs = table
        .iter()
        .enumerate()
        .map(|(r, b)| blob::parse_blob(r, b, rank, net, mine))
        .collect::<Result<Vec<_>>>()?;
    let one_host = blobs.iter().all(|b| b.host == blobs[0].host);
    let choosing = blobs.iter().any(|b| b.extras.iter().any(Option::is_some));
    if !(shm_between_hosts && one_host && !choosing) {
        return Ok((blobs, shm));
    }
    for b in &mut blobs {
        b.shm = None;
    }
    Ok((blobs, None))
}

/// The host id this rank registers: `ROCCL_HOST`'s, the simulated host's, or this host's.
fn host_of(cfg: &Config, rank: usize) -> Result<u64> {
    Ok(match (&cfg.host, cfg.net) {
        (Some(h), _) => bootstrap::host_id_of(h),
        // A simulated rank is on the host of the simulated cluster it sits on: hierarchies
        // and ring orders are simulated as they would run there.
        (None, NetKind::Sim) => {
            bootstrap::host_id_of(&format!("sim-host-{}", cfg.sim.host_of(rank)?))
        }
        (None, _) => bootstrap::host_id(),
    })
}

/// The cost model's inputs (the same on every rank, however the hosts differ: agree.rs), and
/// for a job of several hosts its topology and the costs inside and between hosts.
#[allow(clippy::type_complexity)]
fn cost_and_topology(
    blobs: &[blob::Blob],
    cfg: &Config,
    rank: usize,
    net: &dyn net::Net,
    node: Option<&crate::algo::shm::node::Node>,
) -> (
    LinkCost,
    Option<Arc<crate::algo::topo::Topology>>,
    Option<(LinkCost, LinkCost)>,
) {
    let shm_net = net.name() == "shm";
    let cost = agree::agreed_cost(blobs, shm_net, node.map(|n| (n.slot(), n.cma())));
    let simulated = (cfg.net == NetKind::Sim).then(|| agree::simulated_costs(&cfg.sim, cost));
    let cost = simulated.map_or(cost, |s| s.1);
    // Hosts, and the links inside and between them (hierarchical calls, ring orders).
    let topo = crate::algo::topo::Topology::new(&blobs.iter().map(|b| b.host).collect::<Vec<_>>())
        .with_nics(agree::nics_per_host(blobs));
    if topo.nhosts() < 2 {
        return (cost, None, None);
    }
    let all_shm = blobs.iter().all(|b| b.shm.is_some());
    let intra = match simulated {
        Some(s) => s.0,
        None if all_shm => agree::agreed_cost(blobs, true, None),
        None => cost,
    };
    crate::info!(
        "rank {rank}: {} hosts, {} to {} ranks each on {} NIC(s) (ring order host by host: {}); inside hosts α={:.1}µs β={:.2}GB/s",
        topo.nhosts(),
        (0..blobs.len()).map(|r| topo.local(r).len()).min().unwrap_or(0),
        topo.max_local(),
        topo.nics(),
        if topo.ring_in_rank_order() { "rank order" } else { "reordered" },
        intra.alpha_us,
        intra.beta_gbs
    );
    // SegmentCall exchanges from every rank of a host at once share its NICs (model.rs).
    let m = topo.max_local().max(1);
    let shared = LinkCost {
        nic_share: topo.nics().clamp(1, m) as f64 / m as f64,
        ..cost
    };
    (shared, Some(Arc::new(topo)), Some((intra, cost)))
}

/// The INFO line that says how this rank is set up: network, waits, cost model.
fn log_setup(
    rank: usize,
    cfg: &Config,
    (net, props, local): (&dyn net::Net, &net::NetProperties, std::net::IpAddr),
    name: &str,
    place: &Placement,
    (cost, node): (&LinkCost, Option<&crate::algo::shm::node::Node>),
    blobs: &[blob::Blob],
) {
    if let Some(n) = node {
        crate::info!(
            "rank {rank}: collectives through shared segments on ({} KiB slots; single-copy broadcasts: {})",
            n.slot() >> 10,
            if n.cma() { "yes" } else { "no, process_vm_readv refused" }
        );
    }
    let measured = agree::slowest_speeds(blobs);
    crate::info!(
        "rank {rank}/{}: net {name} on {}{} ({}), {} rank(s) on this host with {} core(s): spin {:?}, yield {:?}, timeout {:?}; cost model α={:.1}µs β={:.2}GB/s message cpu {:.1}µs γ={:.1}GB/s copy {:.1}GB/s (from measured speeds, slowest rank: reduce {:.1}GB/s, copy {:.1}GB/s)",
        place.nranks,
        props.name,
        if net.devices() > 1 {
            format!(
                " and {} more device(s) (large calls take a channel per NIC, {} on every rank)",
                net.devices() - 1,
                cfg.tuning.nics
            )
        } else {
            String::new()
        },
        local,
        place.local_ranks,
        place.cores,
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
}

/// The worker thread's wait (stream-ordered and non-blocking calls): it polls between jobs,
/// spinning only with a core for it next to the application's thread of every rank, and
/// otherwise yields (2 cores, 2 ranks, simulated device: 8 B stream-ordered all-reduce
/// 23.5 µs blocking in the channel at once, 13.4 µs yielding first; docs/PERFORMANCE-LOG.md).
fn worker_wait(cfg: &Config, place: &Placement) -> Waiter {
    Waiter {
        spin: if place.cores >= 2 * place.local_ranks {
            cfg.waiter.spin
        } else {
            Duration::ZERO
        },
        ..cfg.waiter.clone()
    }
}

/// The endpoints connections are made on: the network (ranks of one host start their
/// channels on different NICs: rank i of the host on NIC i, then in turn, so that ranks
/// talking across hosts at once — the calls by host, one rank per local index — each have
/// one), shared memory when there is an endpoint for it, then the extra networks; and the
/// endpoint of each lane (lane 0: the network).
fn endpoints(
    net: Arc<dyn net::Net>,
    listen: Box<dyn net::ListenComm>,
    shm: Option<ShmEndpoint>,
    extras: Vec<Extra>,
    local_index: usize,
) -> (Vec<Endpoint>, [Option<usize>; MAX_LANES]) {
    let mut endpoints = vec![Endpoint {
        dev: local_index % net.devices().max(1),
        net,
        listen,
    }];
    if let Some((n, _, l)) = shm {
        endpoints.push(Endpoint {
            net: n,
            dev: 0,
            listen: l,
        });
    }
    let mut lanes = [None; MAX_LANES];
    lanes[0] = Some(0);
    for x in extras {
        lanes[x.lane] = Some(endpoints.len());
        endpoints.push(Endpoint {
            dev: local_index % x.net.devices().max(1),
            net: x.net,
            listen: x.listen,
        });
    }
    (endpoints, lanes)
}

/// Per peer, the endpoint of each lane both ends have ([`LinkSettings::lanes`]): lane 0 is
/// how the peer is reached (`peer_net`); a peer over the network also gets each extra
/// network it offers too. Empty when this rank offers none.
fn peer_lanes(
    my_lanes: &[Option<usize>; MAX_LANES],
    place: &Placement,
    blobs: &[blob::Blob],
) -> Vec<[Option<usize>; MAX_LANES]> {
    if my_lanes[1..].iter().all(Option::is_none) {
        return Vec::new();
    }
    blobs
        .iter()
        .enumerate()
        .map(|(p, b)| {
            let mut l = [None; MAX_LANES];
            l[0] = Some(place.peer_net[p]);
            if place.peer_net[p] == 0 {
                for (k, lane) in l.iter_mut().enumerate().skip(1) {
                    *lane = my_lanes[k].filter(|_| b.extras[k - 1].is_some());
                }
            }
            l
        })
        .collect()
}

/// The connection table of this rank over `endpoints`, with the peers' handles, the
/// processes this rank can look at, how GPU memory goes to each peer (over the network that
/// takes it, `net_gpu`, not over shared memory), the waits derived from the deadline, and
/// the counters.
fn make_links(
    rank: usize,
    cfg: &Config,
    (nonce, endpoints, my_lanes): (u64, Vec<Endpoint>, [Option<usize>; MAX_LANES]),
    place: &Placement,
    blobs: &[blob::Blob],
    (net_gpu, metrics): (Option<bool>, Arc<crate::metrics::CommMetrics>),
) -> Links {
    // By endpoint: the network's handle, shared memory's (or the network's), then the
    // extras' (the network's where the peer lacks one: no lane leads there).
    let base = endpoints.len() - my_lanes[1..].iter().flatten().count();
    let handles: Vec<Vec<NetHandle>> = blobs
        .iter()
        .map(|b| {
            let s = b.shm.clone().unwrap_or_else(|| b.handle.clone());
            let mut h = vec![b.handle.clone(), s];
            h.truncate(base);
            for (mine, theirs) in my_lanes[1..].iter().zip(&b.extras) {
                if mine.is_some() {
                    h.push(theirs.clone().unwrap_or_else(|| b.handle.clone()));
                }
            }
            h
        })
        .collect();
    let local_pids = blobs
        .iter()
        .map(|b| {
            let here = b.host == place.my_host && b.pid_ns == blobs[rank].pid_ns;
            (here && b.pid != 0).then_some(b.pid)
        })
        .collect();
    let stuck_warn = cfg.stuck_warn.unwrap_or(cfg.waiter.timeout / 3);
    let settings = LinkSettings {
        local_pids,
        timeout_grace: Some((cfg.waiter.timeout / 2).clamp(TIMEOUT_GRACE_MIN, TIMEOUT_GRACE_MAX)),
        stuck_warn: Some(stuck_warn),
        device_mem: place
            .peer_net
            .iter()
            .map(|&n| net_gpu.filter(|_| n == 0))
            .collect(),
        metrics: Some(metrics),
        lanes: peer_lanes(&my_lanes, place, blobs),
    };
    Links::new(
        rank,
        blobs.len(),
        (nonce ^ (nonce >> 32)) as u32,
        endpoints,
        place.peer_net.clone(),
        handles,
        settings,
    )
}

/// The communicator's id in counters and logs: the first 8 bytes of a hash of the id.
fn id_hash(id: &UniqueId) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(&id.as_bytes()[..32]);
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// The communicator's counters (always on, crate::metrics), reading its networks' and
/// shared segments' counters too.
fn comm_metrics(
    (rank, nranks, id_hash): (usize, usize, u64),
    (name, trace): (&'static str, Option<&str>),
    endpoints: &[Endpoint],
    node: Option<&crate::algo::shm::node::Node>,
) -> Arc<crate::metrics::CommMetrics> {
    let names = (
        &super::dispatch::CALL_KINDS[..],
        &crate::algo::Algo::NAMES[..],
    );
    let metrics = crate::metrics::CommMetrics::new(rank, nranks, id_hash, name, names, trace);
    for e in endpoints {
        let w = Arc::downgrade(&e.net);
        metrics.add_net_source(
            e.net.name(),
            Box::new(move |out| {
                if let Some(n) = w.upgrade() {
                    n.counters(out)
                }
            }),
        );
    }
    if let Some(n) = node {
        let s = Arc::clone(&n.stats);
        metrics.add_net_source(
            "shm",
            Box::new(move |out| {
                use std::sync::atomic::Ordering::Relaxed;
                out.push(("node_sleeps", s.sleeps.load(Relaxed)));
                out.push(("node_wakeups", s.wakeups.load(Relaxed)));
            }),
        );
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(local_ranks: usize, local_index: usize, own_processes: bool) -> Placement {
        Placement {
            my_host: 1,
            local_ranks,
            local_index,
            cores: 2,
            peer_net: vec![1; local_ranks],
            shm_peers: local_ranks - 1,
            nranks: local_ranks,
            own_processes,
        }
    }

    /// The CPUs a fresh thread may use after `bind_thread` ran on it once or twice.
    fn after(steps: Vec<(CpuBind, Placement)>) -> Vec<usize> {
        std::thread::spawn(move || {
            for (bind, place) in &steps {
                bind_thread(*bind, place, 0);
            }
            crate::os::allowed_cpus().unwrap()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn a_rank_sharing_cores_is_bound_to_the_cpu_at_its_place_once() {
        let all = crate::os::allowed_cpus().unwrap();
        if all.len() < 2 {
            eprintln!("SKIPPED: this process may run on {} CPU only", all.len());
            return;
        }
        // Rank 2 of 4 on this host: the CPU half-way along the ones allowed.
        let at = |i: usize| vec![all[i * all.len() / 4]];
        assert_eq!(after(vec![(CpuBind::Auto, placed(4, 2, true))]), at(2));
        assert_eq!(after(vec![(CpuBind::Auto, placed(4, 0, true))]), at(0));
        // The first communicator decides: a subgroup where the rank is first stays put.
        assert_eq!(
            after(vec![
                (CpuBind::Auto, placed(4, 3, true)),
                (CpuBind::Auto, placed(2, 0, true))
            ]),
            at(3)
        );
        // Left free: off; a core per rank; ranks that are threads of one process.
        assert_eq!(after(vec![(CpuBind::Off, placed(4, 2, true))]), all);
        assert_eq!(after(vec![(CpuBind::Auto, placed(2, 1, true))]), all);
        assert_eq!(after(vec![(CpuBind::Auto, placed(4, 2, false))]), all);
        // On: bound even with a core per rank.
        assert_eq!(
            after(vec![(CpuBind::On, placed(2, 1, true))]),
            vec![all[all.len() / 2]]
        );
    }
}
