//! Communicator handles of the C ABI: a destroyed handle stays dead, even after the memory
//! of its communicator went to a new one.

use std::os::raw::c_int;

use roccl_capi_core::*;

const SUCCESS: rocclResult_t = 0;
const INVALID_ARGUMENT: rocclResult_t = 4;

fn one_rank_comm() -> rocclComm_t {
    let mut c: rocclComm_t = std::ptr::null_mut();
    // SAFETY: storage for one handle; no device list (host memory).
    let r = unsafe { rocclCommInitAll(&mut c, 1, std::ptr::null()) };
    assert_eq!(r, SUCCESS, "{:?}", last_error());
    c
}

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string it owns.
    unsafe { std::ffi::CStr::from_ptr(rocclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// Create and destroy communicators one after another (the allocator hands the freed
/// handle's memory to the next): every destroyed handle gets rocclInvalidArgument, whatever
/// communicator lives now, and the live one still works.
#[test]
fn a_destroyed_handle_never_names_a_later_communicator() {
    std::env::set_var("ROCCL_SOCKET_IFNAME", "lo");
    let mut dead = Vec::new();
    for _ in 0..20 {
        let live = one_rank_comm();
        for &d in &dead {
            let mut n: c_int = -1;
            // SAFETY: `n` is valid storage; the handle is stale on purpose.
            let r = unsafe { rocclCommCount(d, &mut n) };
            assert_eq!(
                (r, n),
                (INVALID_ARGUMENT, -1),
                "stale handle {d:?} answered (live {live:?}): {}",
                last_error()
            );
            assert!(
                last_error().contains("not a live communicator"),
                "{}",
                last_error()
            );
        }
        let mut n: c_int = -1;
        // SAFETY: as above, on the live handle.
        assert_eq!(unsafe { rocclCommCount(live, &mut n) }, SUCCESS);
        assert_eq!(n, 1);
        // SAFETY: destroying a live handle.
        assert_eq!(unsafe { rocclCommDestroy(live) }, SUCCESS);
        // SAFETY: a second destroy of the same (now stale) handle.
        assert_eq!(unsafe { rocclCommDestroy(live) }, INVALID_ARGUMENT);
        dead.push(live);
    }
}
