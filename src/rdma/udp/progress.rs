//! The background progress thread: what a NIC does without the host. It receives,
//! acknowledges and retransmits while the application is busy elsewhere (otherwise a peer's
//! retry count would run out whenever a rank computes between collectives).
//!
//! It leaves the engine to the application while that polled it within the takeover time
//! ([`super::EngineSettings::takeover`]): then it only sleeps until the takeover time has
//! passed since the last poll. Once it has taken over, it sleeps in `ppoll(2)` on the
//! receive socket until a datagram comes or the engine's next timer is due. With no timer
//! at all (nothing unacknowledged, nothing owed, no closed QP to free) it sleeps on the
//! socket and on [`Nudge`]'s eventfd only, with no time limit: an engine nobody uses (a
//! process group a framework made and never calls) then costs no wake-ups, where before it
//! woke 100 times a second on a core the application may need. The application's next post
//! or poll nudges it awake again (one `write(2)` on that transition only), and dropping the
//! provider does, so that the thread ends.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Driver;

/// The thread sleeps at most this long while an engine timer is pending but far off...
const PROGRESS_IDLE: Duration = Duration::from_millis(10);
/// ...and at least this long (a timer already due is served on waking).
const PROGRESS_MIN_SLEEP: Duration = Duration::from_micros(20);
/// With nothing pending, at INFO it still wakes this often to log the engine's state.
const DUMP_EVERY: Duration = Duration::from_secs(5);

/// Wakes the progress thread out of a sleep without a time limit.
pub(super) struct Nudge {
    fd: OwnedFd,
    /// The thread sleeps without a time limit (set under the driver's lock before it
    /// sleeps, so a post or poll that takes the lock after it sees it).
    deep: AtomicBool,
}

impl Nudge {
    pub(super) fn new() -> std::io::Result<Nudge> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Nudge {
            // SAFETY: `fd` is a new descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            deep: AtomicBool::new(false),
        })
    }

    /// The application posted or polled: wake the thread if it sleeps without a time limit
    /// (it then follows the application again). One relaxed load otherwise.
    #[inline]
    pub(super) fn app_active(&self) {
        if self.deep.load(Ordering::Relaxed) && self.deep.swap(false, Ordering::AcqRel) {
            self.wake();
        }
    }

    /// Wake the thread whatever it does (to stop it).
    pub(super) fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Empty the eventfd after a wake-up.
    fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from a non-blocking eventfd.
        unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

/// The thread's body: `fd` is the receive socket, `stop` ends it (with a nudge).
pub(super) fn progress_thread(
    d: Arc<Mutex<Driver>>,
    nudge: Arc<Nudge>,
    fd: i32,
    stop: Arc<AtomicBool>,
    takeover: Duration,
) {
    let debug = crate::log::level() >= crate::log::Level::Info;
    let mut last_dump = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if debug && last_dump.elapsed() > DUMP_EVERY {
            last_dump = Instant::now();
            let g = d.lock();
            crate::info!(
                "RoCE v2 engine {}: {:?}\n{}",
                g.engine.local(),
                g.engine.stats(),
                g.engine.describe(Instant::now())
            );
        }
        // While the application polls, it drives the engine itself: stay out of its way
        // (no lock contention, no stolen core) and only take over when it goes quiet.
        let idle = d.lock().last_app_poll.elapsed();
        if idle < takeover {
            std::thread::sleep(takeover - idle);
            continue;
        }
        let wait = take_over(&d, &nudge);
        let wait = match (wait, debug) {
            (None, true) => Some(DUMP_EVERY),
            (w, _) => w,
        };
        let nudged = sleep_on(fd, &nudge, wait);
        // Awake: the application need not nudge it (a nudge racing with this leaves a count
        // in the eventfd, which the next sleep drains at once).
        nudge.deep.store(false, Ordering::Release);
        if nudged {
            nudge.drain();
        }
    }
}

/// One round of progress while the application is away; returns how long to sleep, `None`
/// when nothing is pending (then [`Nudge::deep`] is set, under the lock).
fn take_over(d: &Mutex<Driver>, nudge: &Nudge) -> Option<Duration> {
    let mut g = d.lock();
    g.udp.background += 1;
    let _ = g.progress();
    g.wake(None);
    let next = g
        .engine
        .poll_timeout()
        .or_else(|| g.delayed.iter().map(|p| p.at).min());
    // To the microsecond: an acknowledgement due in 100 µs (ACK_DELAY) waits no whole
    // millisecond, which the peer's retransmission timer may not outlast.
    let wait = match next {
        Some(t) => Some(
            t.saturating_duration_since(Instant::now())
                .clamp(PROGRESS_MIN_SLEEP, PROGRESS_IDLE),
        ),
        // Closed QPs are freed after a quiet time: come back for them.
        None if g.closing => Some(PROGRESS_IDLE),
        None => None,
    };
    if wait.is_none() {
        nudge.deep.store(true, Ordering::Release);
    }
    wait
}

/// Sleep in `ppoll(2)` until a datagram on `fd`, a nudge, or `wait` (`None`: no limit);
/// returns whether the nudge's eventfd is readable.
fn sleep_on(fd: i32, nudge: &Nudge, wait: Option<Duration>) -> bool {
    let mut p = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: nudge.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ts = wait.map(|w| libc::timespec {
        tv_sec: w.as_secs() as libc::time_t,
        tv_nsec: w.subsec_nanos() as libc::c_long,
    });
    let tp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
    // SAFETY: `p` holds two valid pollfds and `tp` is null or a valid timespec for the
    // duration of the call; a null signal mask leaves the thread's as it is.
    let n = unsafe { libc::ppoll(p.as_mut_ptr(), 2, tp, std::ptr::null()) };
    n > 0 && p[1].revents & libc::POLLIN != 0
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::{Duration, Instant};

    use super::super::tests::{connected, ping};
    use super::super::{EngineSettings, Faults, UserVerbs};
    use crate::rdma::verbs::Verbs;

    fn open() -> UserVerbs {
        let settings = EngineSettings {
            port: 0,
            takeover: Duration::from_millis(4),
            ..EngineSettings::default()
        };
        UserVerbs::open(IpAddr::from([127, 0, 0, 1]), &settings).unwrap()
    }

    /// Waits up to 5 s for `done`.
    fn within_5s(what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// An engine nobody polls, with nothing pending, makes no rounds (it woke every 10 ms);
    /// a datagram still wakes it, and it receives and acknowledges with nobody polling.
    #[test]
    fn an_idle_engine_sleeps_until_a_datagram_comes() {
        let (a, b) = (open(), open());
        let (qa, qb) = connected(&a, &b);
        std::thread::sleep(Duration::from_millis(30)); // both threads take over
        let before = (a.udp_stats().background, b.udp_stats().background);
        std::thread::sleep(Duration::from_millis(300));
        let rounds = (
            a.udp_stats().background - before.0,
            b.udp_stats().background - before.1,
        );
        assert!(
            rounds.0 <= 2 && rounds.1 <= 2,
            "rounds of idle progress threads in 300 ms: {rounds:?}"
        );
        ping(&a, qa, &b, qb, 1);
        within_5s("b's thread did not receive the write", || {
            b.stats().rx_packets > 0
        });
        within_5s("a's thread did not receive b's acknowledgement", || {
            a.stats().rx_packets > 0
        });
    }

    /// A send posted while the progress thread sleeps with no time limit, whose packets are
    /// lost, is retransmitted by that thread though the application never polls: the post
    /// nudged it awake, and it found the retransmission timer.
    #[test]
    fn a_send_posted_to_a_sleeping_engine_is_retransmitted() {
        let (a, b) = (open(), open());
        let (qa, qb) = connected(&a, &b);
        std::thread::sleep(Duration::from_millis(30)); // a's thread sleeps, no time limit
        a.set_faults(Some(Faults {
            drop: 1.0,
            dup: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            seed: 1,
        }));
        ping(&a, qa, &b, qb, 2);
        std::thread::sleep(Duration::from_millis(5));
        a.set_faults(None);
        within_5s("the lost write was never sent again", || {
            b.stats().rx_packets > 0
        });
        assert!(a.stats().retransmits > 0);
    }

    /// A QP destroyed while the thread sleeps with nothing pending is freed with nobody
    /// polling: the destroy nudged the thread, which frees closed QPs once they are quiet.
    #[test]
    fn a_queue_pair_destroyed_beside_a_sleeping_engine_is_freed() {
        let (a, b) = (open(), open());
        let (qa, qb) = connected(&a, &b);
        std::thread::sleep(Duration::from_millis(30)); // both threads sleep, no time limit
        a.destroy_qp(qa);
        b.destroy_qp(qb);
        within_5s("a destroyed QP was never freed", || {
            a.open_qps() == (0, 0) && b.open_qps() == (0, 0)
        });
    }

    /// Dropping the provider ends its thread, asleep with no time limit: the receive socket
    /// it holds closes, and its port can be bound again.
    #[test]
    fn dropping_the_provider_ends_its_sleeping_thread() {
        let a = open();
        let port = a.local().port();
        std::thread::sleep(Duration::from_millis(30));
        drop(a);
        within_5s(
            "the port stays bound: the progress thread did not end",
            || std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok(),
        );
    }
}
