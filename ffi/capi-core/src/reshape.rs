//! Shrink, grow and revoke under NCCL's contracts (`ncclCommShrink`, `ncclCommGrow`,
//! `ncclCommGetUniqueId`, `ncclCommRevoke`), for the NCCL-named library: the arguments are
//! checked here, the work is the core's (`roccl_core::comm`'s shrink, grow and revoke).

use std::ffi::c_int;

use super::{
    arg, config_of, guard, id_of, make, out_ptr, rank_args, ready, rocclComm_t, rocclConfig_t,
    rocclResult_t, rocclUniqueId,
};

/// `NCCL_SHRINK_ABORT`: revoke the parent first.
const SHRINK_ABORT: c_int = 1;

/// `ncclCommShrink`: a new communicator without the `n_exclude` ranks of `exclude`.
///
/// # Safety
/// `exclude` points at `n_exclude` ints (or is NULL with `n_exclude` 0), `newcomm` at storage
/// for one handle, `config` at a `rocclConfig_t` or is NULL.
pub unsafe fn shrink(
    comm: rocclComm_t,
    exclude: *const c_int,
    n_exclude: c_int,
    newcomm: *mut rocclComm_t,
    config: *const rocclConfig_t,
    flags: c_int,
) -> rocclResult_t {
    guard("ncclCommShrink", || {
        // SAFETY: storage for one handle (NULL refused).
        let out = unsafe { out_ptr(newcomm, "newcomm") }?;
        *out = std::ptr::null_mut();
        if flags & !SHRINK_ABORT != 0 {
            return Err(arg(format!(
                "unknown shrinkFlags {flags:#x} (NCCL_SHRINK_DEFAULT = 0, NCCL_SHRINK_ABORT = 1)"
            )));
        }
        if n_exclude < 0 || (n_exclude > 0 && exclude.is_null()) {
            return Err(arg(format!(
                "excludeRanksCount is {n_exclude} and excludeRanksList is {}",
                if exclude.is_null() { "NULL" } else { "set" }
            )));
        }
        let list: Vec<c_int> = if n_exclude == 0 {
            Vec::new()
        } else {
            // SAFETY: non-NULL, `n_exclude` ints per the contract.
            unsafe { std::slice::from_raw_parts(exclude, n_exclude as usize) }.to_vec()
        };
        if let Some(r) = list.iter().find(|&&r| r < 0) {
            return Err(arg(format!("excluded rank {r} is negative")));
        }
        let list: Vec<usize> = list.iter().map(|&r| r as usize).collect();
        let (blocking, cfg) = config_of(config)?;
        let cfg = (!config.is_null()).then_some(cfg);
        let c = ready(comm)?;
        let me = c.rank();
        make(out, blocking, me, move |abort| {
            c.shrink_abortable(&list, flags & SHRINK_ABORT != 0, cfg, abort)
        })
    })
}

/// `ncclCommRevoke`: stop `comm`'s work; only shrink, destroy and abort remain.
pub fn revoke(comm: rocclComm_t, flags: c_int) -> rocclResult_t {
    guard("ncclCommRevoke", || {
        if flags != 0 {
            return Err(arg(format!(
                "revokeFlags is {flags:#x}; it must be NCCL_REVOKE_DEFAULT (0)"
            )));
        }
        ready(comm)?.revoke();
        Ok(())
    })
}

/// `ncclCommGetUniqueId`: the id the new ranks of `comm`'s next grow join with.
///
/// # Safety
/// `id` points at storage for one id (or is NULL: refused).
pub unsafe fn grow_id(comm: rocclComm_t, id: *mut rocclUniqueId) -> rocclResult_t {
    guard("ncclCommGetUniqueId", || {
        // SAFETY: storage for one id (NULL refused).
        let out = unsafe { out_ptr(id, "uniqueId") }?;
        let u = ready(comm)?.grow_id()?;
        for (o, b) in out.internal.iter_mut().zip(u.as_bytes()) {
            *o = *b as _;
        }
        Ok(())
    })
}

/// `ncclCommGrow`: existing ranks pass `comm` (and rank -1; the one that made the id passes
/// it too), new ranks pass NULL, the id and their rank.
///
/// # Safety
/// `id` is NULL or points at one id, `newcomm` at storage for one handle, `config` at a
/// `rocclConfig_t` or is NULL.
pub unsafe fn grow(
    comm: rocclComm_t,
    nranks: c_int,
    id: *const rocclUniqueId,
    rank: c_int,
    newcomm: *mut rocclComm_t,
    config: *const rocclConfig_t,
) -> rocclResult_t {
    guard("ncclCommGrow", || {
        // SAFETY: storage for one handle (NULL refused).
        let out = unsafe { out_ptr(newcomm, "newcomm") }?;
        *out = std::ptr::null_mut();
        // SAFETY: NULL or one id, per the contract.
        let uid = match unsafe { id.as_ref() } {
            Some(u) => Some(id_of(u)?),
            None => None,
        };
        let (blocking, cfg) = config_of(config)?;
        if comm.is_null() {
            // A new rank.
            let Some(uid) = uid else {
                return Err(arg(
                    "a new rank (comm NULL) needs the uniqueId of ncclCommGetUniqueId",
                ));
            };
            let (n, r) = rank_args(nranks, rank)?;
            return make(out, blocking, r, move |abort| {
                roccl_core::Communicator::init_abortable(&uid, n, r, cfg, abort)
            });
        }
        if rank != -1 {
            return Err(arg(format!(
                "rank is {rank}: ranks of the existing communicator pass -1 (they keep their ranks)"
            )));
        }
        if nranks < 1 {
            return Err(arg(format!("nRanks is {nranks}")));
        }
        let cfg = (!config.is_null()).then_some(cfg);
        let c = ready(comm)?;
        let me = c.rank();
        make(out, blocking, me, move |abort| {
            c.grow(nranks as usize, uid.as_ref(), cfg, abort)
        })
    })
}
