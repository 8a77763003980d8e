//! New communicators from an existing one without a new unique id, as NCCL 2.27+ makes
//! them: shrink (`ncclCommShrink`: without some ranks, and usable after they died), grow
//! (`ncclCommGrow`: with new ranks) and revoke (`ncclCommRevoke`: stop the communicator's
//! work so that only shrink and destroy remain).
//!
//! The ranks meet at a spare rendezvous listener (`bootstrap::spare`) that every rank bound
//! at init and published in its blob, not over the parent's connections: a parent whose
//! connections failed (a dead peer) or were closed (revoke, abort) can still shrink. Every
//! rank computes the new unique id by itself from the parent's job key and the operation's
//! sequence number and arguments, so ranks that disagree meet nobody (they are refused by
//! the root like strangers) and fail at the timeout with a message that says why.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{Communicator, Config};
use crate::bootstrap::auth::JobKey;
use crate::bootstrap::spare::{derived_id, SpareRoot};
use crate::bootstrap::UniqueId;
use crate::error::{Error, Result};

/// What a communicator keeps for shrink and grow.
pub(super) struct Reshape {
    /// This rank's spare listener.
    pub spare: Option<SpareRoot>,
    /// Every rank's spare listener.
    pub spares: Vec<Option<SocketAddr>>,
    /// The parent's job key: the new ids derive from it.
    pub key: JobKey,
    /// The configuration the communicator was made with (new ones inherit it).
    pub cfg: Config,
    /// Shrinks and grows so far: equal on every rank that made the same calls.
    pub count: AtomicU64,
    /// [`Communicator::revoke`] was called.
    pub revoked: AtomicBool,
}

/// What revoke leaves in the communicator's error.
pub const REVOKED: &str =
    "communicator revoked (ncclCommRevoke): only shrink, destroy and abort work on it";

impl Communicator {
    /// Stop this communicator's work for good (NCCL's `ncclCommRevoke`): a call in progress
    /// on another thread returns an error, later calls fail, the connections close; what
    /// remains possible is [`Communicator::shrink`] and dropping it. Returns once no call
    /// runs on it any more.
    pub fn revoke(&self) {
        self.shared.reshape.revoked.store(true, Ordering::Release);
        self.abort_with(REVOKED);
    }

    /// Whether [`Communicator::revoke`] was called.
    pub fn revoked(&self) -> bool {
        self.shared.reshape.revoked.load(Ordering::Acquire)
    }

    /// A new communicator of this one's ranks without `exclude` (NCCL's `ncclCommShrink`),
    /// numbered in this one's order. Every rank not excluded calls it with the same list;
    /// the excluded ranks do not (they may be dead). `abort_first` (`NCCL_SHRINK_ABORT`)
    /// revokes this communicator first, which ends a call still waiting on a dead rank.
    /// `cfg`: the new communicator's configuration (`None`: this one's).
    pub fn shrink(
        &self,
        exclude: &[usize],
        abort_first: bool,
        cfg: Option<Config>,
    ) -> Result<Communicator> {
        self.shrink_abortable(exclude, abort_first, cfg, &AtomicBool::new(false))
    }

    /// [`Communicator::shrink`] that another thread can end by setting `abort` (a
    /// non-blocking shrink's handle being destroyed).
    pub fn shrink_abortable(
        &self,
        exclude: &[usize],
        abort_first: bool,
        cfg: Option<Config>,
        abort: &AtomicBool,
    ) -> Result<Communicator> {
        let (n, me) = (self.nranks(), self.rank());
        let mut out: Vec<usize> = exclude.to_vec();
        out.sort_unstable();
        out.dedup();
        if let Some(&r) = out.iter().find(|&&r| r >= n) {
            return Err(Error::arg(format!(
                "shrink: excluded rank {r} is out of range for {n} ranks"
            )));
        }
        if out.contains(&me) {
            return Err(Error::InvalidUsage(format!(
                "shrink: rank {me} is in its own exclude list: excluded ranks do not call shrink"
            )));
        }
        let kept: Vec<usize> = (0..n).filter(|r| !out.contains(r)).collect();
        if abort_first {
            self.revoke();
        }
        let seq = self.shared.reshape.count.fetch_add(1, Ordering::AcqRel);
        let mut label = format!("roccl shrink v1 {seq} {n}").into_bytes();
        for r in &out {
            label.extend_from_slice(&(*r as u32).to_le_bytes());
        }
        let pos = kept.iter().position(|&r| r == me).expect("not excluded");
        let joined = self.meet(kept[0], &label, kept.len(), pos, cfg, abort);
        joined.map_err(|e| {
            hint(
                e,
                &format!(
                    "shrink of {n} ranks without {}: every other rank must call shrink with the same excluded ranks, as often as this one",
                    crate::error::ranks_list(&out)
                ),
            )
        })
    }

    /// The unique id the new ranks of the next [`Communicator::grow`] join with (NCCL's
    /// `ncclCommGetUniqueId`): the same on every rank of this communicator, so any of them
    /// may hand it out. Pass it to the new ranks out of band.
    pub fn grow_id(&self) -> Result<UniqueId> {
        let seq = self.shared.reshape.count.load(Ordering::Acquire);
        let root = self.spare_of(0)?;
        Ok(derived_id(
            root,
            &self.shared.reshape.key,
            &grow_label(seq),
            self.shared.encrypted,
        ))
    }

    /// A new communicator of `nranks` ranks: this one's ranks keep their numbers, new ranks
    /// join as `self.nranks()` ... `nranks - 1` with [`Communicator::init_with`] and the id
    /// of [`Communicator::grow_id`] (NCCL's `ncclCommGrow`). Every rank of this one calls
    /// it; `id` (optional) is checked against the one this rank computes.
    pub fn grow(
        &self,
        nranks: usize,
        id: Option<&UniqueId>,
        cfg: Option<Config>,
        abort: &AtomicBool,
    ) -> Result<Communicator> {
        let n = self.nranks();
        if nranks < n {
            return Err(Error::arg(format!(
                "grow: {nranks} ranks is fewer than this communicator's {n} (shrink removes ranks)"
            )));
        }
        let expected = self.grow_id()?;
        if id.is_some_and(|i| *i != expected) {
            return Err(Error::arg(
                "grow: the unique id is not this communicator's next grow id (take it from ncclCommGetUniqueId just before the grow, once per grow)",
            ));
        }
        let seq = self.shared.reshape.count.fetch_add(1, Ordering::AcqRel);
        self.meet(0, &grow_label(seq), nranks, self.rank(), cfg, abort)
            .map_err(|e| {
                hint(
                    e,
                    &format!("grow from {n} to {nranks} ranks: every rank of the communicator must call grow, and the {} new ranks must join with the id of ncclCommGetUniqueId", nranks - n),
                )
            })
    }

    /// Rank `r`'s spare listener.
    fn spare_of(&self, r: usize) -> Result<SocketAddr> {
        self.shared.reshape.spares.get(r).copied().flatten().ok_or_else(|| {
            Error::InvalidUsage(format!(
                "rank {r} has no spare rendezvous listener (it could not bind one at init; its log says why): make a new communicator from a new unique id instead"
            ))
        })
    }

    /// Join the rendezvous at rank `root`'s spare listener (served here when this rank is
    /// `root`) as `rank` of `nranks`, under the id of `label`.
    fn meet(
        &self,
        root: usize,
        label: &[u8],
        nranks: usize,
        rank: usize,
        cfg: Option<Config>,
        abort: &AtomicBool,
    ) -> Result<Communicator> {
        let at = self.spare_of(root)?;
        let id = derived_id(at, &self.shared.reshape.key, label, self.shared.encrypted);
        if self.rank() == root {
            let spare = self.shared.reshape.spare.as_ref().ok_or_else(|| {
                Error::Internal("the spare listener this rank published is gone".into())
            })?;
            spare.serve(id)?;
        }
        let cfg = cfg.unwrap_or_else(|| self.shared.reshape.cfg.clone());
        Communicator::init_abortable(&id, nranks, rank, cfg, abort)
    }
}

fn grow_label(seq: u64) -> Vec<u8> {
    format!("roccl grow v1 {seq}").into_bytes()
}

/// `e` with what the ranks must agree on, where disagreeing is a likely cause.
fn hint(e: Error, what: &str) -> Error {
    match e {
        Error::Timeout { waiting_on, msg } => Error::timeout(waiting_on, format!("{what}: {msg}")),
        Error::Remote { rank, cause, msg } => Error::remote(rank, cause, format!("{what}: {msg}")),
        Error::InvalidUsage(m) => Error::InvalidUsage(format!("{what}: {m}")),
        e => e,
    }
}
