//! POSIX shared-memory segments: created (and reserved with `posix_fallocate`, so a full
//! /dev/shm is an error now, not a SIGBUS later), opened by name, mapped with every page
//! populated, unmapped on drop.

use std::ffi::CString;

use crate::error::{Error, Result};

/// A mapped shared-memory segment.
pub struct Segment {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory that this value owns and unmaps once; its users
// (the shared-memory rings, the node segments) reach it through atomics or through ranges
// their protocols give to one side at a time.
unsafe impl Send for Segment {}

impl Segment {
    /// Create and map a segment of `len` bytes under `name`.
    pub fn create(name: &CString, len: usize) -> Result<Segment> {
        // SAFETY: valid NUL-terminated name; flags create a new private segment.
        let fd = unsafe {
            libc::shm_open(
                name.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(Error::last_os(format!(
                "shm_open({}) for a shared-memory connection",
                name.to_string_lossy()
            )));
        }
        // SAFETY: `fd` is ours; posix_fallocate reserves the pages now.
        let r = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if r != 0 {
            // SAFETY: closing and unlinking what we created.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(name.as_ptr());
            }
            return Err(Error::sys(
                format!(
                    "reserving {len} bytes of shared memory in /dev/shm (full? in a container raise --shm-size, or lower ROCCL_SHM_RING / ROCCL_SHM_SLOT)"
                ),
                std::io::Error::from_raw_os_error(r),
            ));
        }
        Self::map(fd, len).inspect_err(|_| {
            // SAFETY: unlinking what we created.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        })
    }

    /// Map the existing segment `name` of `len` bytes.
    pub fn open(name: &CString, len: usize) -> Result<Segment> {
        // SAFETY: valid NUL-terminated name.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(Error::last_os(format!(
                "shm_open({}) of the peer's shared-memory connection (is the peer on this host, in the same IPC namespace?)",
                name.to_string_lossy()
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: i32, len: usize) -> Result<Segment> {
        // A segment shorter than `len` (one its creator has not sized yet, or a stranger's)
        // would fault with SIGBUS at the first touch past its end: refuse it.
        // SAFETY: `st` is written by fstat on our descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open descriptor of ours; `st` is a valid out-pointer.
        let size = if unsafe { libc::fstat(fd, &mut st) } == 0 {
            st.st_size.max(0) as u64
        } else {
            0
        };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me {
            // SAFETY: our descriptor.
            unsafe { libc::close(fd) };
            return Err(Error::InvalidUsage(format!(
                "a shared-memory segment belongs to user {} where this rank runs as user {me}: not one of this job's, refused",
                st.st_uid
            )));
        }
        if size < len as u64 {
            // SAFETY: our descriptor.
            unsafe { libc::close(fd) };
            return Err(Error::InvalidUsage(format!(
                "a shared-memory segment holds {size} bytes where {len} are expected (still being created, or not one of this job's)"
            )));
        }
        // SAFETY: mapping `len` bytes of a segment at least that long (checked above); the
        // fd is closed after.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                // Map every page now: a first touch in the middle of a transfer costs a fault.
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        // SAFETY: our descriptor; the mapping stays valid without it.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap of a shared-memory connection"));
        }
        Ok(Segment {
            base: p.cast(),
            len,
        })
    }

    /// The first byte of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Bytes mapped.
    pub fn size(&self) -> usize {
        self.len
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
