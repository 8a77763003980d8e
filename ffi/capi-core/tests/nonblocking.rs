//! A non-blocking init (rocclCommInitRankConfig with blocking = 0) that cannot finish (its
//! peer never comes) is ended by rocclCommAbort or rocclCommDestroy within about a second,
//! not at ROCCL_TIMEOUT (60 s here), and leaves no init thread behind.

use std::time::{Duration, Instant};

use roccl_capi_core::*;

const SUCCESS: rocclResult_t = 0;
const IN_PROGRESS: rocclResult_t = 7;

/// Threads of this process whose name starts with "roccl-init".
fn init_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.starts_with("roccl-init"))
        .count()
}

/// Start rank 0 of 2 without blocking; rank 1 never starts.
fn lonely_init() -> rocclComm_t {
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: storage for one id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, SUCCESS);
    let mut cfg = CONFIG_INITIALIZER;
    cfg.blocking = 0;
    let mut c: rocclComm_t = std::ptr::null_mut();
    // SAFETY: storage for one handle, a valid config.
    let r = unsafe { rocclCommInitRankConfig(&mut c, 2, id, 0, &mut cfg) };
    assert_eq!(r, IN_PROGRESS);
    // Let it reach the rendezvous, where it waits for rank 1.
    std::thread::sleep(Duration::from_millis(300));
    let mut e = SUCCESS;
    // SAFETY: a live handle, storage for one code.
    assert_eq!(unsafe { rocclCommGetAsyncError(c, &mut e) }, SUCCESS);
    assert_eq!(e, IN_PROGRESS, "the init must still be waiting for rank 1");
    c
}

#[test]
fn a_non_blocking_init_is_ended_by_abort_or_destroy() {
    std::env::set_var("ROCCL_SOCKET_IFNAME", "lo");
    std::env::set_var("ROCCL_TIMEOUT", "60");
    type End = unsafe extern "C" fn(rocclComm_t) -> rocclResult_t;
    for (name, end) in [
        ("rocclCommAbort", rocclCommAbort as End),
        ("rocclCommDestroy", rocclCommDestroy as End),
    ] {
        let c = lonely_init();
        assert_eq!(init_threads(), 1);
        let t = Instant::now();
        // SAFETY: a live handle.
        assert_eq!(unsafe { end(c) }, SUCCESS, "{name}");
        let took = t.elapsed();
        // Generous: the waits look at the abort flag every 100 ms.
        assert!(took < Duration::from_secs(5), "{name} took {took:?}");
        // A joined thread can linger in /proc/self/task for a moment after its exit.
        let gone = Instant::now();
        while init_threads() > 0 && gone.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(init_threads(), 0, "{name} left the init thread running");
    }
}
