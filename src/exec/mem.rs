//! The caller's buffers of one call as the executor borrows them: host memory as slices,
//! GPU memory by address only.

use std::marker::PhantomData;

use crate::error::{Error, Result};

/// A caller buffer of one call, read only: host memory borrowed as a slice, or GPU memory
/// by its address (never turned into a slice: the CPU may not be able to touch it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mem<'a> {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) device: bool,
    pub(super) _borrow: PhantomData<&'a [u8]>,
}

impl<'a> Mem<'a> {
    /// Host memory.
    pub fn host(b: &'a [u8]) -> Self {
        Mem {
            addr: b.as_ptr() as usize,
            len: b.len(),
            device: false,
            _borrow: PhantomData,
        }
    }

    /// GPU memory by address.
    ///
    /// # Safety
    /// `addr..addr + len` is memory of the GPU runtime the call is given, valid for `'a`,
    /// not written by anything else meanwhile.
    pub unsafe fn device(addr: usize, len: usize) -> Self {
        Mem {
            addr,
            len,
            device: true,
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes `off..off + len` of it.
    pub fn part(&self, off: usize, len: usize) -> Mem<'a> {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "part outside the buffer"
        );
        Mem {
            addr: self.addr + off,
            len,
            ..*self
        }
    }

    /// The bytes, for code that reads with the CPU (host memory only).
    pub fn slice(&self) -> Result<&'a [u8]> {
        if self.device {
            return Err(gpu_memory_on_cpu_path());
        }
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: host memory borrowed as a slice for 'a by `Mem::host`.
        Ok(unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) })
    }
}

/// A caller buffer of one call that the call writes (see [`Mem`]).
#[derive(Debug)]
pub(crate) struct MemMut<'a> {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) device: bool,
    pub(super) _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> MemMut<'a> {
    /// Host memory.
    pub fn host(b: &'a mut [u8]) -> Self {
        MemMut {
            addr: b.as_mut_ptr() as usize,
            len: b.len(),
            device: false,
            _borrow: PhantomData,
        }
    }

    /// GPU memory by address.
    ///
    /// # Safety
    /// As [`Mem::device`], and nothing else reads or writes it meanwhile.
    pub unsafe fn device(addr: usize, len: usize) -> Self {
        MemMut {
            addr,
            len,
            device: true,
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes `off..off + len` of it, borrowed from it.
    pub fn part(&mut self, off: usize, len: usize) -> MemMut<'_> {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "part outside the buffer"
        );
        MemMut {
            addr: self.addr + off,
            len,
            device: self.device,
            _borrow: PhantomData,
        }
    }

    /// The buffer, read only, borrowed from it.
    pub fn as_mem(&self) -> Mem<'_> {
        Mem {
            addr: self.addr,
            len: self.len,
            device: self.device,
            _borrow: PhantomData,
        }
    }

    /// Move the buffer out, leaving an empty one.
    pub fn take(&mut self) -> MemMut<'a> {
        std::mem::replace(
            self,
            MemMut {
                addr: 0,
                len: 0,
                device: false,
                _borrow: PhantomData,
            },
        )
    }

    /// The bytes, for code that writes with the CPU (host memory only).
    pub fn into_slice(self) -> Result<&'a mut [u8]> {
        if self.device {
            return Err(gpu_memory_on_cpu_path());
        }
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: host memory borrowed mutably for 'a by `MemMut::host`, consumed here.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) })
    }
}

pub(super) fn gpu_memory_on_cpu_path() -> Error {
    Error::Internal(
        "GPU memory reached a path that reads it with the CPU (shared-memory algorithm or reduction): such calls must be staged".into(),
    )
}
