//! The C ABI (`include/roccl.h`, `ffi/capi-core`) over its argument space: NULL, live,
//! destroyed and made-up communicator handles; counts, data types, reduction ops, roots,
//! peers, colors and streams of any value; NULL or valid (never wild) buffer and result
//! pointers; group calls nested and unbalanced; unique-id bytes. Every call must return a
//! result code: a panic (even one the ABI's guard catches, reported as rocclInternalError)
//! is a crash.
#![no_main]

use std::ffi::{c_int, c_void, CStr};
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use roccl::DataType;
use roccl_capi_core::*;
use roccl_fuzz::Reader;

/// `rocclInternalError`: what the ABI's panic guard returns.
const INTERNAL_ERROR: c_int = 3;
/// Most elements of a fuzzed buffer.
const MAX_ELEMS: usize = 4096;

/// A one-rank communicator shared by every input (made once).
fn live() -> usize {
    static COMM: OnceLock<usize> = OnceLock::new();
    *COMM.get_or_init(|| {
        let mut c: rocclComm_t = null_mut();
        // SAFETY: storage for one handle; devlist may be NULL.
        let rc = unsafe { rocclCommInitAll(&mut c, 1, null()) };
        assert_eq!(rc, 0, "a one-rank communicator");
        c as usize
    })
}

#[derive(Debug, Clone, Copy)]
enum Comm {
    Null,
    Live,
    /// One this input destroyed (or, before any, a made-up value).
    Stale,
    Made(usize),
}

#[derive(Debug, Clone, Copy)]
enum Call {
    ErrorString(c_int),
    LastError(Comm),
    Version(bool),
    Count(Comm, bool),
    UserRank(Comm, bool),
    AsyncError(Comm, bool),
    Finalize(Comm),
    Destroy(Comm),
    Abort(Comm),
    Split {
        comm: Comm,
        color: c_int,
        key: c_int,
        out: bool,
    },
    InitRank {
        out: bool,
        nranks: c_int,
        rank: c_int,
        id: [u8; 128],
    },
    InitAll {
        out: bool,
        ndev: c_int,
    },
    GroupStart,
    GroupEnd,
    Coll(Coll),
    Pair {
        count: u16,
        dt: c_int,
    },
}

#[derive(Debug, Clone, Copy)]
struct Coll {
    kind: u8,
    comm: Comm,
    count: u64,
    dt: c_int,
    op: c_int,
    root: c_int,
    /// 0: buffers of the call's size, 1: NULL buffers, 2: in place, 3: NULL receive buffer.
    bufs: u8,
    stream: usize,
}

fn comm(r: &mut Reader) -> Comm {
    match r.u8() % 4 {
        0 => Comm::Null,
        1 => Comm::Live,
        2 => Comm::Stale,
        _ => Comm::Made(r.u64() as usize),
    }
}

/// The next call: a kind byte (mod 16), then its fields in the order of [`Call`]'s variant
/// (a [`Comm`] is a byte mod 4, then a u64 for a made-up one; ints are little-endian).
fn call(r: &mut Reader) -> Call {
    match r.u8() % 16 {
        0 => Call::ErrorString(r.i32()),
        1 => Call::LastError(comm(r)),
        2 => Call::Version(r.bool()),
        3 => Call::Count(comm(r), r.bool()),
        4 => Call::UserRank(comm(r), r.bool()),
        5 => Call::AsyncError(comm(r), r.bool()),
        6 => Call::Finalize(comm(r)),
        7 => Call::Destroy(comm(r)),
        8 => Call::Abort(comm(r)),
        9 => Call::Split {
            comm: comm(r),
            color: r.i32(),
            key: r.i32(),
            out: r.bool(),
        },
        10 => {
            let out = r.bool();
            let nranks = r.i32();
            let rank = r.i32();
            let mut id = [0u8; 128];
            let b = r.bytes(128);
            id[..b.len()].copy_from_slice(b);
            Call::InitRank {
                out,
                nranks,
                rank,
                id,
            }
        }
        11 => Call::InitAll {
            out: r.bool(),
            ndev: r.i32(),
        },
        12 => Call::GroupStart,
        13 => Call::GroupEnd,
        14 => Call::Coll(Coll {
            kind: r.u8(),
            comm: comm(r),
            count: r.u64(),
            dt: r.i32(),
            op: r.i32(),
            root: r.i32(),
            bufs: r.u8(),
            stream: r.u64() as usize,
        }),
        _ => Call::Pair {
            count: r.u16(),
            dt: r.i32(),
        },
    }
}

struct State {
    stale: usize,
    /// Buffers of the calls queued in a group: they live until the group ends.
    arena: Vec<Vec<u8>>,
}

impl State {
    fn comm(&self, c: Comm) -> rocclComm_t {
        match c {
            Comm::Null => null_mut(),
            Comm::Live => live() as rocclComm_t,
            Comm::Stale => self.stale as rocclComm_t,
            // The live handle is never destroyed by a made-up value that equals it.
            Comm::Made(v) if v == live() => (v ^ 1) as rocclComm_t,
            Comm::Made(v) => v as rocclComm_t,
        }
    }

    /// A buffer of `bytes` kept until the end of the input.
    fn buf(&mut self, bytes: usize) -> *mut c_void {
        self.arena.push(vec![0u8; bytes.max(1)]);
        self.arena.last_mut().unwrap().as_mut_ptr().cast()
    }

    fn call(&mut self, call: Call) {
        let mut int: c_int = 0;
        let out_int = |b: bool, p: &mut c_int| if b { p as *mut c_int } else { null_mut() };
        // SAFETY (every call below): pointers are NULL or point to live storage of the size
        // the call reads or writes; handles are any value (the ABI looks them up).
        let rc = unsafe {
            match call {
                Call::ErrorString(r) => {
                    let s = rocclGetErrorString(r);
                    assert!(!s.is_null());
                    let _ = CStr::from_ptr(s);
                    0
                }
                Call::LastError(c) => {
                    let s = rocclGetLastError(self.comm(c));
                    assert!(!s.is_null());
                    let _ = CStr::from_ptr(s);
                    0
                }
                Call::Version(b) => rocclGetVersion(out_int(b, &mut int)),
                Call::Count(c, b) => rocclCommCount(self.comm(c), out_int(b, &mut int)),
                Call::UserRank(c, b) => rocclCommUserRank(self.comm(c), out_int(b, &mut int)),
                Call::AsyncError(c, b) => {
                    rocclCommGetAsyncError(self.comm(c), out_int(b, &mut int))
                }
                Call::Finalize(c) => rocclCommFinalize(self.comm(c)),
                Call::Destroy(Comm::Live) | Call::Abort(Comm::Live) => 0,
                Call::Destroy(c) => rocclCommDestroy(self.comm(c)),
                Call::Abort(c) => rocclCommAbort(self.comm(c)),
                Call::Split {
                    comm,
                    color,
                    key,
                    out,
                } => {
                    let mut new: rocclComm_t = null_mut();
                    let p = if out {
                        &mut new as *mut rocclComm_t
                    } else {
                        null_mut()
                    };
                    let rc = rocclCommSplit(self.comm(comm), color, key, p, null_mut());
                    if !new.is_null() {
                        assert_eq!(rocclCommDestroy(new), 0);
                        self.stale = new as usize;
                    }
                    rc
                }
                Call::InitRank {
                    out,
                    nranks,
                    rank,
                    mut id,
                } => {
                    // A well-formed id with a valid rank would start a rendezvous with
                    // whatever address the id names: keep to the checks before it.
                    let ranks_ok = nranks >= 1 && (0..nranks).contains(&rank);
                    if ranks_ok && roccl::UniqueId::from_bytes(&id).is_ok() {
                        id[0] ^= 0xff;
                    }
                    let mut uid = rocclUniqueId { internal: [0; 128] };
                    for (d, s) in uid.internal.iter_mut().zip(id) {
                        *d = s as _;
                    }
                    let mut new: rocclComm_t = null_mut();
                    let p = if out {
                        &mut new as *mut rocclComm_t
                    } else {
                        null_mut()
                    };
                    let rc = rocclCommInitRank(p, nranks, uid, rank);
                    assert!(new.is_null());
                    rc
                }
                Call::InitAll { out, ndev } => {
                    // Only the argument checks: a real clique per input is too slow.
                    let ndev = if ndev >= 1 {
                        -ndev.saturating_abs()
                    } else {
                        ndev
                    };
                    let mut new: rocclComm_t = null_mut();
                    let p = if out {
                        &mut new as *mut rocclComm_t
                    } else {
                        null_mut()
                    };
                    rocclCommInitAll(p, ndev, null())
                }
                Call::GroupStart => rocclGroupStart(),
                Call::GroupEnd => rocclGroupEnd(),
                Call::Coll(c) => self.coll(c),
                Call::Pair { count, dt } => {
                    let size = DataType::from_nccl(dt).map_or(8, |d| d.size());
                    let bytes = usize::from(count) % MAX_ELEMS * size;
                    let (s, r) = (self.buf(bytes), self.buf(bytes));
                    let c = live() as rocclComm_t;
                    let n = bytes / size;
                    let mut rc = rocclGroupStart();
                    let a = rocclSend(s, n, dt, 0, c, null_mut());
                    let b = rocclRecv(r, n, dt, 0, c, null_mut());
                    let e = rocclGroupEnd();
                    for x in [a, b, e] {
                        if rc == 0 {
                            rc = x;
                        }
                    }
                    rc
                }
            }
        };
        assert_ne!(rc, INTERNAL_ERROR, "{call:?}: {:?}", last_error());
    }

    /// One collective or point-to-point call (in a group: queued, its buffers kept).
    unsafe fn coll(&mut self, c: Coll) -> c_int {
        let size = DataType::from_nccl(c.dt).map_or(8, |d| d.size());
        let comm = self.comm(c.comm);
        // The live communicator has one rank: a send or receive to rank 0 outside a
        // matched pair would wait for its partner.
        let peer = if c.root == 0 { 1 } else { c.root };
        let stream = c.stream as *mut c_void;
        let (count, send, recv): (usize, *mut c_void, *mut c_void) = match c.bufs % 4 {
            1 => (c.count as usize, null_mut(), null_mut()),
            mode => {
                let count = c.count as usize % MAX_ELEMS;
                let recv = self.buf(count * size);
                let send = match mode {
                    2 => recv,
                    3 => self.buf(count * size),
                    _ => self.buf(count * size),
                };
                let recv = if mode == 3 { null_mut() } else { recv };
                (count, send, recv)
            }
        };
        // SAFETY: buffers of `count` elements of the data type's size (a one-rank
        // communicator: all-gather's and reduce-scatter's whole buffers are one block) or
        // NULL; a data type the ABI does not know is refused before any buffer is read.
        unsafe {
            match c.kind % 9 {
                0 => rocclAllReduce(send, recv, count, c.dt, c.op, comm, stream),
                1 => rocclBroadcast(send, recv, count, c.dt, c.root, comm, stream),
                2 => rocclBcast(recv, count, c.dt, c.root, comm, stream),
                3 => rocclReduce(send, recv, count, c.dt, c.op, c.root, comm, stream),
                4 => rocclAllGather(send, recv, count, c.dt, comm, stream),
                5 => rocclReduceScatter(send, recv, count, c.dt, c.op, comm, stream),
                6 => rocclAlltoAll(send, recv, count, c.dt, comm, stream),
                7 => rocclSend(send, count, c.dt, peer, comm, stream),
                _ => rocclRecv(recv, count, c.dt, peer, comm, stream),
            }
        }
    }
}

fn last_error() -> String {
    // SAFETY: the ABI returns a NUL-terminated string that lives until the next call.
    unsafe { CStr::from_ptr(rocclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

fuzz_target!(|data: &[u8]| {
    let mut r = Reader::new(data);
    let mut st = State {
        stale: 0x10_0000_0000,
        arena: Vec::new(),
    };
    for _ in 0..32 {
        if r.is_empty() {
            break;
        }
        let c = call(&mut r);
        st.call(c);
    }
    // End every group this input left open (their calls run now, buffers still alive).
    for _ in 0..64 {
        if rocclGroupEnd() == 5 {
            break;
        }
    }
});
