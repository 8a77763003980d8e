//! A non-blocking init with `ROCCL_CONNECT=all` (connect every peer during init) whose
//! connect phase cannot finish is ended by rocclCommAbort within a second, not at
//! ROCCL_TIMEOUT (60 s here). Its peer comes to the rendezvous (so the init gets past it) but
//! never connects back: rank 1 is an ordinary lazy-connecting communicator that makes no
//! call. (A separate test binary: it sets ROCCL_CONNECT for the whole process.)

use std::time::{Duration, Instant};

use roccl_capi_core::*;

const SUCCESS: rocclResult_t = 0;
const IN_PROGRESS: rocclResult_t = 7;

/// The init's state through rocclCommGetAsyncError.
fn async_error(c: rocclComm_t) -> rocclResult_t {
    let mut e = SUCCESS;
    // SAFETY: a live handle, storage for one code.
    assert_eq!(unsafe { rocclCommGetAsyncError(c, &mut e) }, SUCCESS);
    e
}

#[test]
fn a_non_blocking_init_connecting_every_peer_is_ended_by_abort() {
    std::env::set_var("ROCCL_SOCKET_IFNAME", "lo");
    std::env::set_var("ROCCL_TIMEOUT", "60");
    std::env::set_var("ROCCL_CONNECT", "all");
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: storage for one id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, SUCCESS);
    let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
    let uid = roccl_core::bootstrap::UniqueId::from_bytes(&bytes).unwrap();
    // Rank 1 joins (blocking) without connecting during init, then makes no call.
    let peer = std::thread::spawn(move || {
        let mut cfg = roccl_core::Config::from_env().unwrap();
        cfg.connect_all = false;
        roccl_core::Communicator::init_with(&uid, 2, 1, cfg).expect("rank 1 init")
    });
    let mut cfg = CONFIG_INITIALIZER;
    cfg.blocking = 0;
    let mut c: rocclComm_t = std::ptr::null_mut();
    // SAFETY: storage for one handle, a valid config.
    let r = unsafe { rocclCommInitRankConfig(&mut c, 2, id, 0, &mut cfg) };
    assert_eq!(r, IN_PROGRESS);
    // Rank 1's init returns once the rendezvous is over: rank 0 is then connecting.
    let _rank1 = peer.join().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        async_error(c),
        IN_PROGRESS,
        "rank 0's init must still be connecting to rank 1"
    );
    let t = Instant::now();
    // SAFETY: a live handle.
    assert_eq!(unsafe { rocclCommAbort(c) }, SUCCESS);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "rocclCommAbort of an init in its connect phase (ROCCL_CONNECT=all) took {took:?}"
    );
}
