//! Memory registration for the userspace engine: regions with lkey/rkey and access flags,
//! and the only place the engine turns an address into bytes (a memory-registration edge).

use crate::error::{Error, Result};

/// Access rights of a memory region (bits as in libibverbs' `ibv_access_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Access(pub u32);

impl Access {
    /// Local write (receives and RDMA READ responses land here).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote RDMA WRITE.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote RDMA READ.
    pub const REMOTE_READ: Access = Access(4);
    /// Everything roccl uses.
    pub const ALL: Access = Access(7);

    /// True if every bit of `o` is set here.
    pub fn has(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

#[derive(Clone, Copy, Debug)]
struct Region {
    /// The address work requests use (for a dmabuf: the registrant's I/O virtual address).
    addr: usize,
    len: usize,
    access: Access,
    key: u32,
    /// Where the bytes of `addr` are for this process: `addr` itself, or inside `mapping`.
    host: usize,
    /// This table's own mapping of a dmabuf (address, length), unmapped with the region.
    mapping: Option<(usize, usize)>,
}

/// Why a memory access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessError {
    /// No region with that key.
    BadKey,
    /// The range leaves the region.
    OutOfBounds,
    /// The region lacks the right.
    Denied,
}

/// The registered regions of one engine. Keys are `index << 16 | 16 random bits` (from the
/// OS random source, unlike the slot's last key): a stale key of a deregistered region does
/// not match its successor, and a stranger cannot guess a key from another.
#[derive(Default)]
pub struct MrTable {
    regions: Vec<Option<Region>>,
}

/// Bits of a key below its slot.
const KEY_SLOT_SHIFT: u32 = 16;

/// The slot of `key`.
fn slot_of(key: u32) -> usize {
    (key >> KEY_SLOT_SHIFT) as usize
}

/// 16 bits from the OS random source for a key, other than `not` (a region's old bits).
fn key_bits(not: Option<u16>) -> Result<u16> {
    loop {
        let mut r = [0u8; 2];
        getrandom::getrandom(&mut r).map_err(|e| {
            Error::Internal(format!(
                "the operating system's random source failed ({e}): cannot make a memory key"
            ))
        })?;
        let bits = u16::from_le_bytes(r);
        if Some(bits) != not {
            return Ok(bits);
        }
    }
}

impl MrTable {
    /// Register `len` bytes at `addr`; returns the key (used as both lkey and rkey).
    ///
    /// # Safety
    /// The memory must stay valid (and writable if `access` allows writes) until
    /// [`MrTable::deregister`]; the engine reads and writes it whenever requests target it.
    pub unsafe fn register(&mut self, addr: usize, len: usize, access: Access) -> Result<u32> {
        if addr == 0 && len > 0 {
            return Err(Error::arg("cannot register a NULL address"));
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::arg("memory region wraps around the address space"));
        }
        let slot = self
            .regions
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.regions.push(None);
                self.regions.len() - 1
            });
        if slot >= 1 << (32 - KEY_SLOT_SHIFT) {
            return Err(Error::arg("too many memory regions (65536 at once)"));
        }
        let key = ((slot as u32) << KEY_SLOT_SHIFT) | u32::from(key_bits(None)?);
        self.regions[slot] = Some(Region {
            addr,
            len,
            access,
            key,
            host: addr,
            mapping: None,
        });
        Ok(key)
    }

    /// Register `len` bytes at `offset` of the dmabuf `fd`, addressed as `iova` in work
    /// requests: the engine maps the buffer itself (as a NIC maps it for DMA) and never
    /// touches `iova`, which need not be readable by this process at all (GPU memory).
    /// Works for any file the kernel lets us map shared (a memfd posing as GPU memory in
    /// tests; a GPU driver's dmabuf only where its exporter allows CPU mappings).
    pub fn register_dmabuf(
        &mut self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: usize,
        access: Access,
    ) -> Result<u32> {
        if len == 0 || iova == 0 {
            return Err(Error::arg("registering an empty or NULL dmabuf range"));
        }
        if iova.checked_add(len).is_none() {
            return Err(Error::arg("memory region wraps around the address space"));
        }
        // A range past the end of the file would map, then fault (SIGBUS) on first use.
        // SAFETY: fstat fills the zeroed struct; `fd` is only inspected.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                return Err(Error::sys(
                    format!("fstat of dmabuf fd {fd}"),
                    std::io::Error::last_os_error(),
                ));
            }
            st.st_size as u64
        };
        if offset
            .checked_add(len as u64)
            .map_or(true, |end| end > size)
        {
            return Err(Error::arg(format!(
                "dmabuf range {offset}+{len} exceeds the {size}-byte buffer of fd {fd}"
            )));
        }
        // SAFETY: sysconf reads a constant of the system.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
        let start = offset - offset % page;
        let delta = (offset - start) as usize;
        let map_len = (len + delta).next_multiple_of(page as usize);
        let off = libc::off_t::try_from(start)
            .map_err(|_| Error::arg(format!("dmabuf offset {offset} is too large")))?;
        // SAFETY: a new shared mapping chosen by the kernel; it aliases no Rust object and is
        // unmapped only when the region is removed (or the table dropped).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::sys(
                format!(
                    "mmap of dmabuf fd {fd} ({len} bytes at offset {offset}) by the userspace RoCE engine: it maps registered dmabufs as a NIC would; the exporter must allow CPU mappings"
                ),
                std::io::Error::last_os_error(),
            ));
        }
        let host = p as usize + delta;
        // SAFETY: the mapping stays until the region goes (deregister / drop unmap it).
        let key = match unsafe { self.register(iova, len, access) } {
            Ok(k) => k,
            Err(e) => {
                // SAFETY: the mapping made above, not yet shared with any region.
                unsafe { libc::munmap(p, map_len) };
                return Err(e);
            }
        };
        if let Some(Some(r)) = self.regions.get_mut(slot_of(key)) {
            r.host = host;
            r.mapping = Some((p as usize, map_len));
        }
        Ok(key)
    }

    /// Give region `key` the rights `access` and a new key (as `ibv_rereg_mr` with
    /// `IBV_REREG_MR_CHANGE_ACCESS`, and a new rkey): the old key no longer reaches it.
    /// Returns the new key.
    pub fn rekey(&mut self, key: u32, access: Access) -> Result<u32> {
        let r = self
            .regions
            .get_mut(slot_of(key))
            .and_then(|r| r.as_mut())
            .filter(|r| r.key == key)
            .ok_or_else(|| Error::arg(format!("no memory region with key {key:#x}")))?;
        let bits = key_bits(Some(key as u16))?;
        r.key = (key & !0xffff) | u32::from(bits);
        r.access = access;
        Ok(r.key)
    }

    /// Remove a registration.
    pub fn deregister(&mut self, key: u32) -> Result<()> {
        match self.regions.get_mut(slot_of(key)) {
            Some(r @ Some(_)) if r.as_ref().is_some_and(|x| x.key == key) => {
                if let Some(Region {
                    mapping: Some((a, l)),
                    ..
                }) = r.take()
                {
                    // SAFETY: the region's own mapping (register_dmabuf); the region is gone,
                    // so nothing can reach it any more.
                    unsafe { libc::munmap(a as *mut libc::c_void, l) };
                }
                Ok(())
            }
            _ => Err(Error::arg(format!("no memory region with key {key:#x}"))),
        }
    }

    fn find(
        &self,
        key: u32,
        addr: u64,
        len: usize,
        need: Access,
    ) -> std::result::Result<usize, AccessError> {
        let r = self
            .regions
            .get(slot_of(key))
            .and_then(|r| r.as_ref())
            .filter(|r| r.key == key)
            .ok_or(AccessError::BadKey)?;
        let addr = usize::try_from(addr).map_err(|_| AccessError::OutOfBounds)?;
        let end = addr.checked_add(len).ok_or(AccessError::OutOfBounds)?;
        if addr < r.addr || end > r.addr + r.len {
            return Err(AccessError::OutOfBounds);
        }
        if !r.access.has(need) {
            return Err(AccessError::Denied);
        }
        Ok(r.host + (addr - r.addr))
    }

    /// Check that `[addr, addr+len)` is inside region `key` with rights `need`.
    pub fn check(
        &self,
        key: u32,
        addr: u64,
        len: usize,
        need: Access,
    ) -> std::result::Result<(), AccessError> {
        self.find(key, addr, len, need).map(|_| ())
    }

    /// Copy `data` into registered memory.
    pub fn write(
        &self,
        key: u32,
        addr: u64,
        data: &[u8],
        need: Access,
    ) -> std::result::Result<(), AccessError> {
        let a = self.find(key, addr, data.len(), need)?;
        if !data.is_empty() {
            // SAFETY: the range lies inside a registered region that allows writing (checked);
            // the registrant guarantees it stays valid until deregistration. `copy` tolerates
            // overlap with `data` (a loopback write within one region).
            unsafe { std::ptr::copy(data.as_ptr(), a as *mut u8, data.len()) };
        }
        Ok(())
    }

    /// Borrow registered memory for reading (to build an outgoing packet).
    pub fn read(
        &self,
        key: u32,
        addr: u64,
        len: usize,
        need: Access,
    ) -> std::result::Result<&[u8], AccessError> {
        let a = self.find(key, addr, len, need)?;
        if len == 0 {
            return Ok(&[]);
        }
        // SAFETY: inside a registered region (checked), valid until deregistration; the slice
        // lives only while the table is borrowed, i.e. while a packet is being encoded.
        Ok(unsafe { std::slice::from_raw_parts(a as *const u8, len) })
    }
}

impl Drop for MrTable {
    fn drop(&mut self) {
        for (a, l) in self.regions.iter().flatten().filter_map(|r| r.mapping) {
            // SAFETY: mappings made by register_dmabuf; the table and its regions are gone.
            unsafe { libc::munmap(a as *mut libc::c_void, l) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys of successive registrations in one slot are not a counter (before: the key's
    /// low byte counted 1, 2, 3...), and an old key never reaches its successor.
    #[test]
    fn memory_keys_are_not_guessable() {
        let mut buf = vec![0u8; 64];
        let mut t = MrTable::default();
        let mut keys = Vec::new();
        for _ in 0..8 {
            // SAFETY: `buf` outlives the table's use below.
            let k =
                unsafe { t.register(buf.as_mut_ptr() as usize, 64, Access::REMOTE_WRITE) }.unwrap();
            keys.push(k);
            t.deregister(k).unwrap();
        }
        let steps = keys
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) == 1)
            .count();
        assert!(steps < 3, "sequential keys: {keys:x?}");
        // SAFETY: as above.
        let last =
            unsafe { t.register(buf.as_mut_ptr() as usize, 64, Access::REMOTE_WRITE) }.unwrap();
        let base = buf.as_ptr() as u64;
        for k in keys.into_iter().filter(|k| *k != last) {
            assert_eq!(
                t.write(k, base, &[1], Access::REMOTE_WRITE),
                Err(AccessError::BadKey)
            );
        }
    }

    /// A region rekeyed to local rights: its old key reaches nothing, the new one cannot be
    /// written remotely; given remote rights back, it has yet another key.
    #[test]
    fn rekeying_revokes_remote_access() {
        let mut buf = vec![0u8; 64];
        let mut t = MrTable::default();
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        // SAFETY: `buf` outlives the table's use below.
        let k = unsafe { t.register(buf.as_mut_ptr() as usize, 64, rw) }.unwrap();
        let base = buf.as_ptr() as u64;
        t.write(k, base, &[1], Access::REMOTE_WRITE).unwrap();
        let local = t.rekey(k, Access::LOCAL_WRITE).unwrap();
        assert_ne!(local, k);
        assert_eq!(local >> 16, k >> 16, "same slot");
        assert_eq!(
            t.write(k, base, &[2], Access::REMOTE_WRITE),
            Err(AccessError::BadKey)
        );
        assert_eq!(
            t.write(local, base, &[2], Access::REMOTE_WRITE),
            Err(AccessError::Denied)
        );
        t.write(local, base, &[3], Access::LOCAL_WRITE).unwrap();
        let again = t.rekey(local, rw).unwrap();
        assert_ne!(again, local);
        t.write(again, base, &[4], Access::REMOTE_WRITE).unwrap();
        assert_eq!(
            t.write(local, base, &[5], Access::LOCAL_WRITE),
            Err(AccessError::BadKey)
        );
        assert!(t.rekey(local, rw).is_err(), "an old key cannot rekey");
        assert_eq!(buf[0], 4);
        t.deregister(again).unwrap();
    }

    #[test]
    fn keys_bounds_and_rights() {
        let mut buf = vec![0u8; 64];
        let mut t = MrTable::default();
        // SAFETY: `buf` outlives the table's use below.
        let k = unsafe {
            t.register(
                buf.as_mut_ptr() as usize,
                64,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
        }
        .unwrap();
        let base = buf.as_ptr() as u64;
        t.write(k, base + 60, &[1, 2, 3, 4], Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(
            t.read(k, base + 60, 4, Access::default()).unwrap(),
            &[1, 2, 3, 4]
        );
        assert_eq!(
            t.write(k, base + 61, &[0; 4], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.write(k, base - 1, &[0; 1], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.read(k, base, 4, Access::REMOTE_READ).unwrap_err(),
            AccessError::Denied
        );
        assert_eq!(
            t.read(k ^ 1, base, 4, Access::default()).unwrap_err(),
            AccessError::BadKey
        );
        t.deregister(k).unwrap();
        assert_eq!(
            t.read(k, base, 4, Access::default()).unwrap_err(),
            AccessError::BadKey
        );
        // SAFETY: as above.
        let k2 = unsafe { t.register(buf.as_mut_ptr() as usize, 64, Access::ALL) }.unwrap();
        assert_ne!(k, k2, "a stale key must not reach the new region");
        assert!(t.deregister(k).is_err());
        drop(buf);
    }
}
