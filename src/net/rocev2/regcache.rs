//! A per-comm cache of memory registrations.
//!
//! Collectives send from and receive into the same user buffers call after call; registering
//! them once instead of per request takes registration off the data path (on a NIC,
//! `ibv_reg_mr` costs tens of microseconds and pins pages). An entry covers an exact address
//! range with given access rights; any request inside it reuses it. Entries in use by
//! requests in flight are never evicted; the least recently used idle one makes room.
//!
//! Caching is only sound where a registration pins nothing and the provider touches
//! registered memory only while work targets it, so that a buffer freed (and its address
//! reused) with a registration still cached is harmless: the userspace engine
//! ([`crate::rdma::verbs::Verbs::cacheable_registrations`]). Elsewhere every request
//! registers and deregisters its own buffers, as before.
//!
//! A cached entry with remote rights loses them when its last request is done (the
//! application has its buffer back): the provider gives it local rights only and a new key
//! ([`Verbs::rekey_mr`]), so an rkey seen on the wire in a clear-to-send reaches nothing
//! once the receive completed; the next request that needs remote rights gets them back
//! under yet another key (docs/SECURITY.md).
//!
//! Explicit registrations (`regMr`) are kept the same way: each is given only the rights
//! its comm's use needs ([`Pinned::access`]: local ones on a send comm; remote write on a
//! receive comm, and remote read on a receive comm's GPU memory, which flushes read), and
//! holds them only while a request or a flush uses it. The application's handle is a
//! registration id ([`RegCache::pin`]), which stays the same while the keys change. A
//! provider that cannot change rights (a NIC: `ibv_rereg_mr` would cost a system call per
//! receive) keeps them for the registration's life, as NCCL's own transports do.

use crate::error::Result;
use crate::rdma::verbs::{Access, Mr, Verbs};

/// Entries per comm.
pub const CAPACITY: usize = 32;

struct Entry {
    mr: Mr,
    access: Access,
    /// Idle, with its remote rights revoked (see the module's doc).
    revoked: bool,
    /// Requests in flight using it.
    users: u32,
    last_use: u64,
}

/// A registration the application made explicitly (`regMr`, `regMrDmaBuf`): used by every
/// request inside it, never evicted, released by [`RegCache::unpin`].
#[derive(Clone, Copy, Debug)]
pub struct Pinned {
    /// The registration (its keys change as it gains and loses remote rights).
    pub mr: Mr,
    /// The rights it has while requests use it.
    pub access: Access,
    /// GPU memory the CPU must not touch: sent and received without CPU copies, flushed
    /// after receives.
    pub device: bool,
}

/// The cache of one comm. Dropping it does not deregister: call [`RegCache::clear`].
/// An explicit registration in the cache.
struct PinnedEntry {
    pinned: Pinned,
    /// The id the application holds ([`RegCache::pin`]).
    id: u64,
    /// Requests (and flushes) in flight using it.
    users: u32,
    /// Whether the provider changes its rights: it then has remote ones only while used.
    revocable: bool,
    /// Idle, with its remote rights revoked.
    revoked: bool,
}

/// Whether `access` reaches memory from the network.
fn remote(access: Access) -> bool {
    access.has(Access::REMOTE_WRITE) || access.has(Access::REMOTE_READ)
}

/// Whether `mr` covers `addr..addr+len`.
fn covers(mr: &Mr, addr: u64, len: usize) -> bool {
    mr.addr <= addr && addr + len as u64 <= mr.addr + mr.len as u64
}

pub struct RegCache {
    enabled: bool,
    entries: Vec<Entry>,
    /// Explicit registrations.
    pinned: Vec<PinnedEntry>,
    /// The id of the next explicit registration.
    next_id: u64,
    clock: u64,
    /// Lookups served from the cache, and registrations made.
    pub hits: u64,
    /// Registrations made (misses).
    pub misses: u64,
}

impl RegCache {
    /// A cache for `verbs` (disabled when its registrations are not cacheable).
    pub fn new(verbs: &dyn Verbs) -> RegCache {
        RegCache {
            enabled: verbs.cacheable_registrations(),
            entries: Vec::with_capacity(CAPACITY),
            pinned: Vec::new(),
            next_id: 1,
            clock: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// A registration covering `addr..addr+len` with `access`, marked in use until
    /// [`RegCache::release`].
    ///
    /// # Safety
    /// As [`Verbs::reg_mr`]: the memory stays valid while requests use the registration.
    pub unsafe fn acquire(
        &mut self,
        verbs: &dyn Verbs,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<Mr> {
        self.clock += 1;
        if let Some(p) = self
            .pinned
            .iter_mut()
            .find(|p| covers(&p.pinned.mr, addr, len) && p.pinned.access.has(access))
        {
            if p.revoked {
                p.pinned.mr = verbs.rekey_mr(&p.pinned.mr, p.pinned.access)?;
                p.revoked = false;
            }
            p.users += 1;
            self.hits += 1;
            return Ok(p.pinned.mr);
        }
        if self.enabled {
            if let Some(i) = self
                .entries
                .iter()
                .position(|e| covers(&e.mr, addr, len) && e.access.has(access))
            {
                let e = &mut self.entries[i];
                if e.revoked {
                    match verbs.rekey_mr(&e.mr, e.access) {
                        Ok(m) => {
                            e.mr = m;
                            e.revoked = false;
                        }
                        Err(_) => {
                            let e = self.entries.swap_remove(i);
                            let _ = verbs.dereg_mr(&e.mr);
                            // SAFETY: forwarded contract.
                            return unsafe { self.acquire(verbs, addr, len, access) };
                        }
                    }
                }
                e.users += 1;
                e.last_use = self.clock;
                self.hits += 1;
                return Ok(e.mr);
            }
        }
        self.misses += 1;
        // SAFETY: forwarded contract.
        let mr = unsafe { verbs.reg_mr(addr, len, access)? };
        if !self.enabled {
            return Ok(mr);
        }
        if self.entries.len() == CAPACITY {
            // Make room: the least recently used entry nobody uses, else do not cache.
            let victim = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    let e = self.entries.swap_remove(i);
                    let _ = verbs.dereg_mr(&e.mr);
                }
                None => return Ok(mr), // released (deregistered) by `release`
            }
        }
        self.entries.push(Entry {
            mr,
            access,
            revoked: false,
            users: 1,
            last_use: self.clock,
        });
        Ok(mr)
    }

    /// The explicit registration covering `addr..addr+len` with `access` (when in use),
    /// if any. Its keys are the current ones: use [`RegCache::acquire`] for keys to post.
    pub fn pinned_for(&self, addr: u64, len: usize, access: Access) -> Option<Pinned> {
        self.pinned
            .iter()
            .map(|p| p.pinned)
            .find(|p| covers(&p.mr, addr, len) && p.access.has(access))
    }

    /// Whether `addr..addr+len` lies in GPU memory registered explicitly.
    pub fn is_device(&self, addr: u64, len: usize) -> bool {
        self.pinned_for(addr, len, Access::default())
            .is_some_and(|p| p.device)
    }

    /// Keep an explicit registration (see [`Pinned`]), made with the rights it has in
    /// use; the id the application holds for it. Its remote rights are revoked until a
    /// request uses it, where the provider can change rights.
    pub fn pin(&mut self, verbs: &dyn Verbs, mut pinned: Pinned) -> u64 {
        let mut revoked = false;
        if remote(pinned.access) {
            if let Ok(mr) = verbs.rekey_mr(&pinned.mr, Access::LOCAL_WRITE) {
                pinned.mr = mr;
                revoked = true;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.pinned.push(PinnedEntry {
            pinned,
            id,
            users: 0,
            revocable: revoked,
            revoked,
        });
        id
    }

    /// Deregister the explicit registration with id `id` (from [`RegCache::pin`]).
    pub fn unpin(&mut self, verbs: &dyn Verbs, id: u64) -> Result<()> {
        let i = self
            .pinned
            .iter()
            .position(|p| p.id == id)
            .ok_or_else(|| {
                crate::error::Error::arg(format!(
                    "deregistering unknown memory registration {id} (never registered on this connection, or deregistered already)"
                ))
            })?;
        if self.pinned[i].users > 0 {
            return Err(crate::error::Error::InvalidUsage(format!(
                "deregistering memory that {} request(s) in flight still use: deregister it after they complete",
                self.pinned[i].users
            )));
        }
        let p = self.pinned.swap_remove(i);
        verbs.dereg_mr(&p.pinned.mr)
    }

    /// A request is done with `mr` (from [`RegCache::acquire`]).
    pub fn release(&mut self, verbs: &dyn Verbs, mr: &Mr) {
        if let Some(p) = self.pinned.iter_mut().find(|p| p.pinned.mr.lkey == mr.lkey) {
            p.users = p.users.saturating_sub(1);
            if p.users == 0 && p.revocable {
                match verbs.rekey_mr(&p.pinned.mr, Access::LOCAL_WRITE) {
                    Ok(m) => {
                        p.pinned.mr = m;
                        p.revoked = true;
                    }
                    // It keeps its rights (the provider changed them before): say so.
                    Err(e) => {
                        crate::warn!(
                            "an explicit registration keeps its remote rights while idle: {e}"
                        );
                        p.revocable = false;
                    }
                }
            }
            return;
        }
        let Some(i) = self.entries.iter().position(|e| e.mr.lkey == mr.lkey) else {
            let _ = verbs.dereg_mr(mr);
            return;
        };
        let e = &mut self.entries[i];
        e.users = e.users.saturating_sub(1);
        if e.users == 0 && remote(e.access) {
            match verbs.rekey_mr(&e.mr, Access::LOCAL_WRITE) {
                Ok(m) => {
                    e.mr = m;
                    e.revoked = true;
                }
                Err(_) => {
                    // A provider that cannot revoke: do not keep the registration.
                    let e = self.entries.swap_remove(i);
                    let _ = verbs.dereg_mr(&e.mr);
                }
            }
        }
    }

    /// Deregister everything (the comm is closing).
    pub fn clear(&mut self, verbs: &dyn Verbs) {
        for e in self.entries.drain(..) {
            let _ = verbs.dereg_mr(&e.mr);
        }
        for p in self.pinned.drain(..) {
            let _ = verbs.dereg_mr(&p.pinned.mr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::rdma::verbs::{QpEndpoint, QpId, QpState, RecvWr, SendWr, Wc};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    /// Counts registrations; `cacheable` says what it tells the cache; keys live, with
    /// whether each has remote rights; `rekeys` says whether it can change rights.
    struct Counting {
        cacheable: bool,
        rekeys: bool,
        next: AtomicU32,
        live: Mutex<Vec<u32>>,
        remote: Mutex<Vec<u32>>,
    }

    impl Counting {
        fn new(cacheable: bool) -> Counting {
            Counting {
                cacheable,
                rekeys: true,
                next: AtomicU32::new(1),
                live: Mutex::new(Vec::new()),
                remote: Mutex::new(Vec::new()),
            }
        }
        fn live(&self) -> usize {
            self.live.lock().unwrap().len()
        }
        /// Keys that reach memory remotely now.
        fn remote(&self) -> Vec<u32> {
            self.remote.lock().unwrap().clone()
        }
    }

    impl Verbs for Counting {
        fn name(&self) -> String {
            "counting".into()
        }
        unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr> {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            self.live.lock().unwrap().push(k);
            if remote(access) {
                self.remote.lock().unwrap().push(k);
            }
            Ok(Mr {
                addr,
                len,
                lkey: k,
                rkey: k,
            })
        }
        fn dereg_mr(&self, mr: &Mr) -> Result<()> {
            let mut l = self.live.lock().unwrap();
            let i = l
                .iter()
                .position(|k| *k == mr.lkey)
                .expect("double deregistration");
            l.swap_remove(i);
            self.remote.lock().unwrap().retain(|k| *k != mr.lkey);
            Ok(())
        }
        fn rekey_mr(&self, mr: &Mr, access: Access) -> Result<Mr> {
            if !self.rekeys {
                return Err(Error::Internal("cannot rekey".into()));
            }
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            let mut l = self.live.lock().unwrap();
            let i = l.iter().position(|x| *x == mr.lkey).expect("a live key");
            l[i] = k;
            let mut r = self.remote.lock().unwrap();
            r.retain(|x| *x != mr.lkey);
            if remote(access) {
                r.push(k);
            }
            Ok(Mr {
                lkey: k,
                rkey: k,
                ..*mr
            })
        }
        fn cacheable_registrations(&self) -> bool {
            self.cacheable
        }
        fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
            Err(Error::Internal("not used by the cache".into()))
        }
        fn connect_qp(&self, _: QpId, _: &QpEndpoint) -> Result<()> {
            Err(Error::Internal("not used by the cache".into()))
        }
        fn destroy_qp(&self, _: QpId) {}
        fn post_send(&self, _: QpId, _: &SendWr) -> Result<()> {
            Err(Error::Internal("not used by the cache".into()))
        }
        fn post_recv(&self, _: QpId, _: &RecvWr) -> Result<()> {
            Err(Error::Internal("not used by the cache".into()))
        }
        fn poll_cq(&self, _: QpId, _: &mut [Wc]) -> Result<usize> {
            Err(Error::Internal("not used by the cache".into()))
        }
        fn poll_fds(&self, _: &mut Vec<crate::net::PollFd>) {}
        fn qp_state(&self, _: QpId) -> Result<QpState> {
            Err(Error::Internal("not used by the cache".into()))
        }
        unsafe fn read_registered(&self, _: u64, _: &mut [u8]) {}
    }

    const RW: Access = Access(3);

    #[test]
    fn reuses_covering_entries_and_evicts_only_idle_ones() {
        let v = Counting::new(true);
        let mut c = RegCache::new(&v);
        // SAFETY (all acquires): the fake provider touches no memory.
        let a = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        c.release(&v, &a);
        let b = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        let sub = unsafe { c.acquire(&v, 0x1800, 100, Access::LOCAL_WRITE) }.unwrap();
        // The same registration (one live), under a new key since it was idle.
        assert_ne!(b.lkey, a.lkey);
        assert_eq!(sub.lkey, b.lkey);
        assert_eq!((c.hits, c.misses, v.live()), (2, 1, 1));
        // More rights than the entry has, or a range beyond it: new registrations.
        let all = unsafe { c.acquire(&v, 0x1000, 4096, Access::ALL) }.unwrap();
        let beyond = unsafe { c.acquire(&v, 0x1000, 4097, RW) }.unwrap();
        assert!(all.lkey != a.lkey && beyond.lkey != a.lkey && all.lkey != beyond.lkey);
        assert_eq!(v.live(), 3);
        for m in [b, sub, all, beyond] {
            c.release(&v, &m);
        }
        // Fill it with idle entries: the least recently used ones make room.
        for i in 0..CAPACITY as u64 {
            let m = unsafe { c.acquire(&v, 0x10_0000 * (i + 1), 64, RW) }.unwrap();
            c.release(&v, &m);
        }
        assert_eq!(v.live(), CAPACITY);
        let again = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        assert_ne!(again.lkey, a.lkey, "the oldest entries were evicted");
        // Entries in use are never evicted: with all of them busy, a new registration is
        // not cached and goes away at release.
        let busy: Vec<Mr> = (0..CAPACITY as u64 - 1)
            .map(|i| unsafe { c.acquire(&v, 0x10_0000 * (i + 1), 64, RW) }.unwrap())
            .collect();
        let extra = unsafe { c.acquire(&v, 0x9999_0000, 64, RW) }.unwrap();
        assert_eq!(v.live(), CAPACITY + 1);
        c.release(&v, &extra);
        assert_eq!(v.live(), CAPACITY);
        for m in &busy {
            c.release(&v, m);
        }
        c.release(&v, &again);
        c.clear(&v);
        assert_eq!(v.live(), 0);
    }

    /// A receive buffer's cached registration loses its remote rights when its last
    /// request is done: the key a peer was told reaches nothing once the application has
    /// the buffer back; the next request gets remote rights under a new key.
    #[test]
    fn idle_entries_lose_remote_rights() {
        let v = Counting::new(true);
        let mut c = RegCache::new(&v);
        // SAFETY (all acquires): the fake provider touches no memory.
        let a = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        let a2 = unsafe { c.acquire(&v, 0x1000, 64, RW) }.unwrap();
        assert_eq!(a.lkey, a2.lkey);
        assert_eq!(v.remote(), vec![a.rkey]);
        c.release(&v, &a);
        assert_eq!(v.remote(), vec![a.rkey], "still in use by a2");
        c.release(&v, &a2);
        assert!(v.remote().is_empty(), "idle: no remote key");
        assert_eq!(v.live(), 1, "still cached");
        let b = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        assert_eq!(v.remote(), vec![b.rkey]);
        assert!(b.rkey != a.rkey);
        c.release(&v, &b);
        assert!(v.remote().is_empty());
        // Local-only entries are not rekeyed.
        let l = unsafe { c.acquire(&v, 0x9000, 64, Access::LOCAL_WRITE) }.unwrap();
        c.release(&v, &l);
        let l2 = unsafe { c.acquire(&v, 0x9000, 64, Access::LOCAL_WRITE) }.unwrap();
        assert_eq!(l.lkey, l2.lkey);
        c.release(&v, &l2);
        c.clear(&v);
        assert_eq!(v.live(), 0);
        // A provider that cannot change rights: idle remote entries are not kept.
        let v = Counting {
            rekeys: false,
            ..Counting::new(true)
        };
        let mut c = RegCache::new(&v);
        let a = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        c.release(&v, &a);
        assert_eq!((v.live(), v.remote().len()), (0, 0));
        c.clear(&v);
    }

    /// An explicit registration has remote rights only while requests (or flushes) use
    /// it; its id stays while its keys change. On a provider that cannot change rights it
    /// keeps them.
    #[test]
    fn explicit_registrations_have_remote_rights_only_in_use() {
        for rekeys in [true, false] {
            let v = Counting {
                rekeys,
                ..Counting::new(false)
            };
            let mut c = RegCache::new(&v);
            // SAFETY (all registrations): the fake provider touches no memory.
            let mr = unsafe { v.reg_mr(0x1000, 4096, RW) }.unwrap();
            let pinned = Pinned {
                mr,
                access: RW,
                device: false,
            };
            let id = c.pin(&v, pinned);
            let idle = |_: &Counting| usize::from(!rekeys);
            assert_eq!(v.remote().len(), idle(&v), "idle (rekeys: {rekeys})");
            let a = unsafe { c.acquire(&v, 0x1000, 64, RW) }.unwrap();
            let b = unsafe { c.acquire(&v, 0x1800, 64, RW) }.unwrap();
            assert_eq!((a.lkey, v.remote()), (b.lkey, vec![a.rkey]));
            c.release(&v, &a);
            assert_eq!(v.remote(), vec![a.rkey], "still in use by b");
            c.release(&v, &b);
            assert_eq!(v.remote().len(), idle(&v), "idle again (rekeys: {rekeys})");
            let again = unsafe { c.acquire(&v, 0x1000, 64, RW) }.unwrap();
            assert_eq!(again.lkey != a.lkey, rekeys, "a new key only when rekeyed");
            assert!(c.unpin(&v, id).is_err(), "in use: not deregistered");
            c.release(&v, &again);
            assert_eq!((c.hits, c.misses, v.live()), (3, 0, 1));
            c.unpin(&v, id).unwrap();
            assert_eq!(v.live(), 0);
            assert!(
                c.unpin(&v, id).is_err(),
                "a second deregistration is refused"
            );
            // Local rights only: never rekeyed.
            let mr = unsafe { v.reg_mr(0x1000, 64, Access::LOCAL_WRITE) }.unwrap();
            let local = Pinned {
                mr,
                access: Access::LOCAL_WRITE,
                device: false,
            };
            let id = c.pin(&v, local);
            let m = unsafe { c.acquire(&v, 0x1000, 64, Access::default()) }.unwrap();
            assert_eq!(m.lkey, mr.lkey);
            let other = unsafe { c.acquire(&v, 0x1000, 64, RW) }.unwrap();
            assert_ne!(
                other.lkey, mr.lkey,
                "more rights: a registration of its own"
            );
            c.release(&v, &other);
            c.release(&v, &m);
            assert_eq!(
                c.pinned_for(0x1000, 64, Access::default()).unwrap().mr.lkey,
                mr.lkey
            );
            c.unpin(&v, id).unwrap();
            assert_eq!(v.live(), 0);
            c.clear(&v);
        }
    }

    #[test]
    fn off_for_providers_that_cannot_cache() {
        let v = Counting::new(false);
        let mut c = RegCache::new(&v);
        // SAFETY: the fake provider touches no memory.
        let a = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        let b = unsafe { c.acquire(&v, 0x1000, 4096, RW) }.unwrap();
        assert_ne!(a.lkey, b.lkey);
        assert_eq!((c.hits, c.misses, v.live()), (0, 2, 2));
        c.release(&v, &a);
        c.release(&v, &b);
        assert_eq!(v.live(), 0);
        c.clear(&v);
    }
}
