//! Entry points for the fuzz targets (`fuzz/`, the `fuzzing` feature; not an API): thin
//! wrappers that run roccl's private parsers of untrusted bytes without I/O, each with the
//! checks its callers rely on. Every function must return (never panic) whatever its
//! arguments; the engine and packet codec are public and fuzzed through `rdma` directly.

use std::net::SocketAddr;

use crate::error::Result;
use crate::net::NetHandle;
use crate::rdma::verbs::QpEndpoint;

/// A network's setup bytes: a connection handle and a setup message whose tag has been
/// checked (what the listener parses after authentication). `net`: 0 TCP (the message is a
/// hello), 1 RoCE v2 (a setup message or answer), 2 shared memory (a segment-name message);
/// any other value runs the bytes through all three.
pub fn net_setup(net: u8, handle: &[u8], msg: &[u8]) {
    let _ = NetHandle::from_bytes(handle);
    match net {
        0 => crate::net::tcp::fuzz(handle, msg),
        1 => crate::net::rocev2::fuzz(handle, msg),
        2 => crate::net::shm::fuzz(handle, msg),
        _ => {
            crate::net::tcp::fuzz(handle, msg);
            crate::net::rocev2::fuzz(handle, msg);
            crate::net::shm::fuzz(handle, msg);
        }
    }
}

/// Everything a connection to the bootstrap root sent so far, through the root's
/// registration parser; `sign`: first give it this job's nonce and a good tag (as far as
/// its length goes), so that the checks after authentication run too.
pub fn registration(b: &[u8], sign: bool) {
    crate::bootstrap::fuzz_registration(b, sign);
}

/// A registration of `blob` as rank `rank` of `nranks`, signed for [`registration`]'s job.
pub fn seed_registration(rank: usize, nranks: usize, blob: &[u8]) -> Vec<u8> {
    crate::bootstrap::fuzz_seed_registration(rank, nranks, blob)
}

/// A rendezvous table (every rank's blob), parsed as rank 0 parses it, and the cost model's
/// agreement over it (`shm_net`: the network is shared memory; `node`: the node segments'
/// slot size and whether single copies work).
pub fn rendezvous_table(table: &[&[u8]], shm_net: bool, node: Option<(usize, bool)>) {
    crate::comm::fuzz(table, shm_net, node);
}

/// A rendezvous blob of this process for network `net` with `handle` (and a shared-memory
/// handle): a seed for [`rendezvous_table`].
pub fn seed_blob(handle: &NetHandle, net: &str, shm: Option<&NetHandle>) -> Result<Vec<u8>> {
    crate::comm::fuzz_seed_blob(handle, net, shm)
}

/// A RoCE v2 handle of a listener at `setup` and a setup message of a queue pair at `ep`:
/// seeds for [`net_setup`].
pub fn seed_rocev2(setup: SocketAddr, ep: &QpEndpoint) -> (Vec<u8>, Vec<u8>) {
    crate::net::rocev2::fuzz_seed(setup, ep)
}

/// A message of the hello protocol between ranks (the first message of every connection,
/// and the abort, mismatch and suspend notices), as a listener of communicator `comm_id`
/// with `nranks` ranks reads it; what reads must write back to the same bytes.
pub fn hello(bytes: &[u8], comm_id: u32, nranks: usize) {
    crate::exec::hello::fuzz(bytes, comm_id, nranks);
}

/// A message of each kind of the hello protocol, from rank 1 of communicator `comm_id`:
/// seeds for [`hello`].
pub fn seed_hellos(comm_id: u32) -> Vec<Vec<u8>> {
    crate::exec::hello::fuzz_seeds(comm_id)
}
