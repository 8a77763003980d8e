//! NCCL's versioned structs as the caller built them: `ncclConfig_t` (2.32's layout,
//! `ncclConfig_v23100`) read only as far as the caller's `size` and `version` say it has
//! fields, and `ncclCollConfig_t` checked.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use super::{fail, ncclResult_t, INVALID_ARGUMENT};

/// `NCCL_API_MAGIC`.
pub const API_MAGIC: u32 = 0xcafe_beef;

/// `ncclConfig_t` of NCCL 2.32 up to the fields roccl reads (later fields follow in the
/// caller's struct; none is read).
#[repr(C)]
#[allow(dead_code)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
}

// NCCL's offsets (the C test asserts them against the real header too).
const _: () = assert!(std::mem::offset_of!(NcclConfig, blocking) == 16);
const _: () = assert!(std::mem::offset_of!(NcclConfig, net_name) == 32);
const _: () = assert!(std::mem::offset_of!(NcclConfig, comm_name) == 48);

/// The NCCL version that added each field roccl reads: `blocking` … `netName` came with
/// configs (2.14), `splitShare` with 2.18, `trafficClass` and `commName` with 2.19.
const WITH_CONFIG: u32 = 21400;
const WITH_COMM_NAME: u32 = 21900;

/// What an `ncclConfig_t` asks of roccl.
pub struct Asked {
    /// roccl's config for the C layer (`blocking`, `net_name`).
    pub roccl: capi::rocclConfig_t,
    /// Keeps the network name `roccl.net_name` points at alive.
    _net: Option<CString>,
    /// `commName`, for the log.
    pub name: Option<String>,
}

/// Whether field `end` (its end offset in the struct) exists in a config of `size` bytes
/// and `version`, introduced by `since`.
fn has(size: usize, version: u32, end: usize, since: u32) -> bool {
    size >= end && version >= since
}

/// Read the caller's `ncclConfig_t` (NULL: none).
pub fn read(config: *const c_void, func: &str) -> Result<Option<Asked>, ncclResult_t> {
    if config.is_null() {
        return Ok(None);
    }
    // SAFETY: a non-NULL config points at the caller's struct, which starts with its size,
    // magic and version (16 bytes, in every NCCL version); nothing beyond them is read
    // before `size` is known.
    let (size, magic, version) = unsafe {
        let p = config as *const u8;
        (
            *(p as *const usize),
            *(p.add(8) as *const u32),
            *(p.add(12) as *const u32),
        )
    };
    if magic != API_MAGIC || size < 16 {
        return Err(fail(
            INVALID_ARGUMENT,
            &format!("{func}: the ncclConfig_t was not initialized with NCCL_CONFIG_INITIALIZER (magic {magic:#x}, size {size})"),
        ));
    }
    let mut out = capi::CONFIG_INITIALIZER;
    let mut net = None;
    let mut name = None;
    let base = config as *const u8;
    // SAFETY (each read below): the field lies within the caller's `size` bytes (checked by
    // `has`), at its offset in NCCL's layout.
    let int_at = |o: usize| unsafe { *(base.add(o) as *const c_int) };
    let ptr_at = |o: usize| unsafe { *(base.add(o) as *const *const c_char) };
    if has(size, version, 20, WITH_CONFIG) {
        out.blocking = int_at(16);
    }
    if has(size, version, 40, WITH_CONFIG) {
        let p = ptr_at(32);
        if !p.is_null() {
            // SAFETY: a non-NULL netName is a NUL-terminated string, per the API.
            let n = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            let ours = match n.to_ascii_lowercase().as_str() {
                "socket" => "tcp".to_string(),
                "ib" => "rocev2".to_string(),
                _ => n.clone(),
            };
            if ours.parse::<roccl_core::net::NetKind>().is_err() {
                return Err(fail(
                    INVALID_ARGUMENT,
                    &format!("{func}: config.netName {n:?} is not a network roccl has: use \"Socket\" or \"tcp\", \"IB\" or \"rocev2\", \"shm\", \"auto\", or leave it NULL (ROCCL_NET then decides)"),
                ));
            }
            let c = CString::new(ours).unwrap_or_default();
            out.net_name = c.as_ptr();
            net = Some(c);
        }
    }
    if has(size, version, 56, WITH_COMM_NAME) {
        let p = ptr_at(48);
        if !p.is_null() {
            // SAFETY: a non-NULL commName is a NUL-terminated string, per the API.
            name = Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    Ok(Some(Asked {
        roccl: out,
        _net: net,
        name,
    }))
}

/// Check the caller's `ncclCollConfig_t` (NULL: the plain call). roccl's choices are its
/// own (the CTA and algorithm fields are for NCCL's kernels); a config that was never
/// initialized is refused.
pub fn check_coll(config: *const c_void, func: &str) -> Result<(), ncclResult_t> {
    if config.is_null() {
        return Ok(());
    }
    // SAFETY: a non-NULL config points at the caller's struct, which starts with its size
    // (8 bytes) and magic (4 bytes).
    let (size, magic) = unsafe {
        let p = config as *const u8;
        (*(p as *const usize), *(p.add(8) as *const u32))
    };
    if magic != API_MAGIC || size < 16 {
        return Err(fail(
            INVALID_ARGUMENT,
            &format!("{func}: the ncclCollConfig_t was not initialized with NCCL_COLLCONFIG_INITIALIZER (magic {magic:#x}, size {size})"),
        ));
    }
    Ok(())
}
