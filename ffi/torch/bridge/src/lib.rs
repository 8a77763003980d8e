//! The bridge between roccl's torch.distributed backend (C++, `ffi/torch/csrc`) and the Rust
//! core, through `cxx`. An FFI edge: the C++ side passes tensor addresses and lengths (in
//! bytes) that torch gave it, and they become slices here, after their checks, and nowhere
//! else. Every function runs behind a panic guard and returns `Result`, so that roccl's
//! errors reach C++ as exceptions that carry roccl's message, with this rank's number, and
//! no panic crosses the boundary.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use roccl_core::{CallOpts, Collective, Communicator, Config, DataType, P2p, RedOp, UniqueId};

#[cxx::bridge(namespace = "roccl_torch")]
// `collective` takes its buffers as address and length pairs: ten plain arguments.
#[allow(clippy::too_many_arguments)]
mod bridge {
    /// Which collective [`Comm::collective`] runs.
    #[derive(Debug)]
    enum Kind {
        AllReduce,
        Broadcast,
        Reduce,
        AllGather,
        ReduceScatter,
        AllToAll,
        Barrier,
    }

    /// Element types, numbered as NCCL's `ncclDataType_t` (and roccl's `DataType`).
    #[derive(Debug)]
    enum Dtype {
        I8 = 0,
        U8 = 1,
        I32 = 2,
        U32 = 3,
        I64 = 4,
        U64 = 5,
        F16 = 6,
        F32 = 7,
        F64 = 8,
        Bf16 = 9,
        F8E4M3 = 10,
        F8E5M2 = 11,
    }

    /// Reductions, numbered as NCCL's `ncclRedOp_t` (and roccl's `RedOp`).
    #[derive(Debug)]
    enum Reduction {
        Sum = 0,
        Prod = 1,
        Max = 2,
        Min = 3,
        Avg = 4,
    }

    /// Rank, size and rendezvous address of a launch, read from the launcher's environment.
    #[derive(Debug)]
    struct Launch {
        /// `roccl`, `torchrun`, `ompi`, `mpich` or `slurm`.
        launcher: String,
        rank: usize,
        nranks: usize,
        /// Rank 0's host (empty when the environment names no host).
        host: String,
        /// The port roccl's conventions give the launch there.
        port: u16,
    }

    extern "Rust" {
        type Comm;

        /// What the launcher's environment says (srun, mpirun, torchrun or ROCCL_*), by
        /// roccl's own rules (`Communicator::from_env`).
        fn launcher_env() -> Result<Launch>;

        /// A new unique id (this process serves its rendezvous root), with its secret (for
        /// `roccl.unique_id()`: the application hands it to every rank its own way).
        fn unique_id() -> Result<Vec<u8>>;
        /// A new unique id for torch's Store, which does not authenticate its readers: its
        /// public part only (root address and nonce). Its secret is the launcher's
        /// `ROCCL_JOB_SECRET`, which [`init_published`] adds on every rank.
        fn store_id() -> Result<Vec<u8>>;
        /// [`init`] with an id of [`store_id`]: completed with `ROCCL_JOB_SECRET` here.
        fn init_published(
            id: &[u8],
            nranks: usize,
            rank: usize,
            timeout_ms: u64,
            deterministic: bool,
        ) -> Result<Box<Comm>>;
        /// Join the communicator of `id` as `rank` of `nranks`; `timeout_ms` replaces
        /// `ROCCL_TIMEOUT`, `deterministic` turns the deterministic mode on (as
        /// `ROCCL_DETERMINISTIC=1`; the other `ROCCL_*` settings apply).
        fn init(
            id: &[u8],
            nranks: usize,
            rank: usize,
            timeout_ms: u64,
            deterministic: bool,
        ) -> Result<Box<Comm>>;
        fn rank(self: &Comm) -> usize;
        fn nranks(self: &Comm) -> usize;
        /// The network the communicator uses (`shm`, `tcp`, `tcp+shm`, ...).
        fn net_name(self: &Comm) -> String;
        /// Run one collective now, on this thread. `in_place`: the input is in `recv`.
        /// `timeout_ms`: this call's timeout (0: the communicator's).
        ///
        /// # Safety
        /// `send_addr` (unless `in_place`) is readable for `send_bytes` bytes and
        /// `recv_addr` writable for `recv_bytes` bytes until this returns, and nothing else
        /// writes them meanwhile.
        unsafe fn collective(
            self: &Comm,
            kind: Kind,
            dtype: Dtype,
            op: Reduction,
            root: usize,
            send_addr: usize,
            send_bytes: usize,
            in_place: bool,
            recv_addr: usize,
            recv_bytes: usize,
            timeout_ms: u64,
        ) -> Result<()>;
        /// Run sends (`sends[i]`) and receives together, to and from `peers[i]`, on the
        /// buffers `addrs[i]` of `bytes[i]` bytes; messages between two ranks match in order.
        /// `timeout_ms`: this call's timeout (0: the communicator's).
        ///
        /// # Safety
        /// Each buffer is readable (a send) or writable (a receive) for its length until this
        /// returns, and nothing else writes it meanwhile.
        unsafe fn exchange(
            self: &Comm,
            sends: &[bool],
            peers: &[usize],
            addrs: &[usize],
            bytes: &[usize],
            timeout_ms: u64,
        ) -> Result<()>;
        /// Close the connections now: a call blocked on another thread returns an error.
        fn abort(self: &Comm);
        /// The error that made the communicator unusable, or an empty string.
        fn async_error(self: &Comm) -> String;
    }
}

pub use bridge::{Dtype, Kind, Launch, Reduction};

/// A communicator, shared by the backend's threads (a call and `abort` may overlap).
pub struct Comm {
    inner: Arc<Communicator>,
}

/// The text of a panic's payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `f` behind a panic guard; errors get `label()` (the rank and the call: " rank R/N",
/// "what", formatted only on an error, so that a call that succeeds allocates nothing here)
/// in front.
fn guarded<T>(
    label: impl FnOnce() -> (String, String),
    f: impl FnOnce() -> Result<T, String>,
) -> Result<T, String> {
    let r = catch_unwind(AssertUnwindSafe(f));
    let text = |e: String| {
        let (who, what) = label();
        format!("roccl{who}: {what}: {e}")
    };
    match r {
        Ok(r) => r.map_err(text),
        Err(p) => Err(text(format!(
            "internal error (a bug in roccl, please report it): {}",
            panic_text(&*p)
        ))),
    }
}

fn unique_id() -> Result<Vec<u8>, String> {
    guarded(
        || (String::new(), "creating the unique id".into()),
        || {
            UniqueId::new()
                .map(|id| id.as_bytes().to_vec())
                .map_err(|e| e.to_string())
        },
    )
}

fn store_id() -> Result<Vec<u8>, String> {
    guarded(
        || {
            (
                String::new(),
                "creating the unique id for torch's Store".into(),
            )
        },
        || {
            let id = UniqueId::new_for_publishing(roccl_core::bootstrap::seal::requested())
                .map_err(|e| e.to_string())?;
            if !id.has_secret() {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    roccl_core::warn!(
                        "no ROCCL_JOB_SECRET / ROCCL_JOB_SECRET_FILE: the process group's ranks are authenticated by what torch's Store holds (the root's address and a random nonce); anyone who can read the Store (torch's TCPStore does not authenticate its clients) can join. Give every rank the same secret (e.g. ROCCL_JOB_SECRET=$(openssl rand -hex 16) exported before launching) to refuse them"
                    )
                });
            }
            Ok(id.public().as_bytes().to_vec())
        },
    )
}

fn init_published(
    id: &[u8],
    nranks: usize,
    rank: usize,
    timeout_ms: u64,
    deterministic: bool,
) -> Result<Box<Comm>, String> {
    let who = format!(" rank {rank}");
    let id = guarded(
        || (who, "reading the unique id from torch's Store".into()),
        || {
            UniqueId::from_bytes(id)
                .and_then(|i| i.with_job_secret())
                .map(|i| i.as_bytes().to_vec())
                .map_err(|e| {
                    format!("{e} (the id read from torch's Store is not rank 0's roccl unique id)")
                })
        },
    )?;
    init(&id, nranks, rank, timeout_ms, deterministic)
}

fn launcher_env() -> Result<Launch, String> {
    guarded(
        || (String::new(), "reading the launcher's environment".into()),
        || {
            let env = roccl_core::bootstrap::env::from_env().map_err(|e| e.to_string())?;
            let (host, port) = match env.root {
                roccl_core::bootstrap::env::Root::Addr { host, port } => (host, port),
                _ => (String::new(), 0),
            };
            Ok(Launch {
                launcher: env.launcher.to_string(),
                rank: env.rank,
                nranks: env.nranks,
                host,
                port,
            })
        },
    )
}

fn init(
    id: &[u8],
    nranks: usize,
    rank: usize,
    timeout_ms: u64,
    deterministic: bool,
) -> Result<Box<Comm>, String> {
    let who = format!(" rank {rank}");
    guarded(
        || (who, "joining the communicator".into()),
        || {
            let id = UniqueId::from_bytes(id).map_err(|e| {
                format!("{e} (the id read from torch's Store is not rank 0's roccl unique id)")
            })?;
            let mut cfg = Config::from_env().map_err(|e| e.to_string())?;
            if timeout_ms > 0 {
                cfg.waiter.timeout = Duration::from_millis(timeout_ms);
            }
            cfg.deterministic |= deterministic;
            let c = Communicator::init_with(&id, nranks, rank, cfg).map_err(|e| e.to_string())?;
            Ok(Box::new(Comm { inner: Arc::new(c) }))
        },
    )
}

/// A call's error as torch users read it: a timeout says "Timed out" (as Gloo's do, and as
/// torch's own tests of timeouts look for) and whom it waited on; others as roccl says them.
fn call_error(e: roccl_core::Error) -> String {
    match e {
        roccl_core::Error::Timeout { waiting_on, msg } if waiting_on.is_empty() => {
            format!("Timed out without progress: {msg}")
        }
        roccl_core::Error::Timeout { waiting_on, msg } => {
            let ranks: Vec<String> = waiting_on.iter().map(|r| r.to_string()).collect();
            let s = if ranks.len() == 1 { "" } else { "s" };
            format!("Timed out waiting on rank{s} {}: {msg}", ranks.join(", "))
        }
        e => e.to_string(),
    }
}

fn dtype_of(d: Dtype) -> Result<DataType, String> {
    DataType::from_nccl(i32::from(d.repr)).ok_or_else(|| format!("unknown data type {}", d.repr))
}

fn op_of(o: Reduction) -> Result<RedOp, String> {
    RedOp::from_nccl(i32::from(o.repr)).ok_or_else(|| format!("unknown reduction {}", o.repr))
}

/// A call's options: its own timeout when `timeout_ms` is not 0.
fn call_opts(timeout_ms: u64) -> CallOpts {
    CallOpts {
        timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)),
        ..Default::default()
    }
}

/// Checks an address and length from C++.
fn check_buf(addr: usize, len: usize, name: &str) -> Result<(), String> {
    if len > 0 && addr == 0 {
        return Err(format!("{name} is NULL but its length is {len} bytes"));
    }
    if len > isize::MAX as usize || addr.checked_add(len).is_none() {
        return Err(format!("{name} of {len} bytes overflows the address space"));
    }
    Ok(())
}

fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// # Safety
/// `addr` is readable for `len` bytes while the slice lives (checked by `check_buf`).
unsafe fn read<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: non-NULL (check_buf) and readable for `len` bytes per the caller's contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// # Safety
/// `addr` is writable for `len` bytes while the slice lives, and no other slice over it is
/// used meanwhile.
unsafe fn write<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: non-NULL (check_buf), writable per the caller's contract; callers refuse
    // buffers that overlap another one of the same call.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

impl Comm {
    fn who(&self) -> String {
        format!(" rank {}/{}", self.inner.rank(), self.inner.nranks())
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn nranks(&self) -> usize {
        self.inner.nranks()
    }

    fn net_name(&self) -> String {
        self.inner.net_name().to_string()
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn collective(
        &self,
        kind: Kind,
        dtype: Dtype,
        op: Reduction,
        root: usize,
        send_addr: usize,
        send_bytes: usize,
        in_place: bool,
        recv_addr: usize,
        recv_bytes: usize,
        timeout_ms: u64,
    ) -> Result<(), String> {
        guarded(
            || (self.who(), format!("{kind:?}")),
            || {
                let dt = dtype_of(dtype)?;
                let coll = match kind {
                    Kind::AllReduce => Collective::AllReduce(op_of(op)?),
                    Kind::Broadcast => Collective::Broadcast { root },
                    Kind::Reduce => Collective::Reduce {
                        op: op_of(op)?,
                        root,
                    },
                    Kind::AllGather => Collective::AllGather,
                    Kind::ReduceScatter => Collective::ReduceScatter(op_of(op)?),
                    Kind::AllToAll => Collective::AllToAll,
                    Kind::Barrier => Collective::Barrier,
                    _ => return Err(format!("unknown collective {}", kind.repr)),
                };
                check_buf(recv_addr, recv_bytes, "the output")?;
                if !in_place {
                    check_buf(send_addr, send_bytes, "the input")?;
                    if overlap((send_addr, send_bytes), (recv_addr, recv_bytes)) {
                        return Err(
                        "the input and the output overlap without being the same buffer (run it in place, or pass separate tensors)"
                            .into(),
                    );
                    }
                }
                // SAFETY: the caller's contract; checked above for NULL, overflow and overlap.
                let send = (!in_place).then(|| unsafe { read(send_addr, send_bytes) });
                // SAFETY: as above.
                let recv = unsafe { write(recv_addr, recv_bytes) };
                self.inner
                    .run_raw(coll, dt, send, recv, &call_opts(timeout_ms))
                    .map(|_| ())
                    .map_err(call_error)
            },
        )
    }

    unsafe fn exchange(
        &self,
        sends: &[bool],
        peers: &[usize],
        addrs: &[usize],
        bytes: &[usize],
        timeout_ms: u64,
    ) -> Result<(), String> {
        guarded(
            || (self.who(), "send/recv".into()),
            || {
                let n = sends.len();
                if peers.len() != n || addrs.len() != n || bytes.len() != n {
                    return Err(
                        "the lists of sends, peers, buffers and lengths differ in length".into(),
                    );
                }
                for i in 0..n {
                    check_buf(addrs[i], bytes[i], "a buffer")?;
                    if peers[i] >= self.inner.nranks() {
                        return Err(format!(
                            "peer {} is out of range for {} ranks",
                            peers[i],
                            self.inner.nranks()
                        ));
                    }
                    for j in 0..i {
                        if (!sends[i] || !sends[j])
                            && overlap((addrs[i], bytes[i]), (addrs[j], bytes[j]))
                        {
                            return Err(
                            "two buffers of one send/recv batch overlap, one of them for receiving"
                                .into(),
                        );
                        }
                    }
                }
                let mut ops: Vec<P2p<'_>> = (0..n)
                    .map(|i| {
                        if sends[i] {
                            P2p::Send {
                                peer: peers[i],
                                // SAFETY: the caller's contract; checked above.
                                buf: unsafe { read(addrs[i], bytes[i]) },
                            }
                        } else {
                            P2p::Recv {
                                peer: peers[i],
                                // SAFETY: the caller's contract; checked above, no overlap.
                                buf: unsafe { write(addrs[i], bytes[i]) },
                            }
                        }
                    })
                    .collect();
                self.inner
                    .p2p_with(&mut ops, &call_opts(timeout_ms))
                    .map_err(call_error)
            },
        )
    }

    fn abort(&self) {
        let _ = catch_unwind(AssertUnwindSafe(|| self.inner.abort()));
    }

    fn async_error(&self) -> String {
        catch_unwind(AssertUnwindSafe(|| self.inner.async_error()))
            .ok()
            .flatten()
            .map(|e| e.message)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks as threads: an all-reduce through the bridge's byte interface, a batch of
    /// sends and receives, and errors that name the rank and the call.
    #[test]
    fn collectives_and_errors_through_the_bridge() {
        std::env::set_var("ROCCL_NET", "tcp");
        let id = unique_id().unwrap();
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let id = id.clone();
                std::thread::spawn(move || {
                    let c = init(&id, 2, r, 20_000, false).unwrap();
                    let mut x = [r as f32 + 1.0; 3];
                    // SAFETY: x lives across the call.
                    unsafe {
                        c.collective(
                            Kind::AllReduce,
                            Dtype::F32,
                            Reduction::Sum,
                            0,
                            0,
                            0,
                            true,
                            x.as_mut_ptr() as usize,
                            12,
                            0,
                        )
                    }
                    .unwrap();
                    assert_eq!(x, [3.0; 3]);
                    let out = [r as u8; 4];
                    let mut got = [9u8; 4];
                    let peer = 1 - r;
                    // SAFETY: both buffers live across the call.
                    unsafe {
                        c.exchange(
                            &[true, false],
                            &[peer, peer],
                            &[out.as_ptr() as usize, got.as_mut_ptr() as usize],
                            &[4, 4],
                            0,
                        )
                    }
                    .unwrap();
                    assert_eq!(got, [peer as u8; 4]);
                    // SAFETY: refused before any access (overlapping input and output).
                    let e = unsafe {
                        c.collective(
                            Kind::AllReduce,
                            Dtype::F32,
                            Reduction::Sum,
                            0,
                            x.as_ptr() as usize + 4,
                            8,
                            false,
                            x.as_mut_ptr() as usize,
                            8,
                            0,
                        )
                    }
                    .unwrap_err();
                    assert!(e.contains(&format!("rank {r}/2")), "{e}");
                    assert!(e.contains("overlap"), "{e}");
                    // SAFETY: refused before any access (NULL with a length).
                    let e = unsafe { c.exchange(&[true], &[peer], &[0], &[4], 0) }.unwrap_err();
                    assert!(e.contains("NULL"), "{e}");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_bad_unique_id_is_refused_with_a_reason() {
        let e = init(&[1, 2, 3], 2, 0, 1000, false).err().unwrap();
        assert!(e.contains("rank 0") && e.contains("unique id"), "{e}");
    }
}
