//! Waiting that fits the machine: spin for a bounded time, then yield, then block in
//! `poll(2)` on the descriptors of the pending requests.
//!
//! Spinning gives the lowest latency when every rank has a core; yielding and then
//! sleeping keep 4 ranks on 2 cores from starving each other. `ROCCL_SPIN_US` (default 50)
//! and `ROCCL_YIELD_US` (default 200) bound the first two phases; `ROCCL_TIMEOUT` (seconds,
//! default 300) bounds the time without any progress before an error names the peers.

use std::time::{Duration, Instant};

/// A file descriptor the caller can `poll(2)` to sleep until a comm can make progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollFd {
    /// The descriptor.
    pub fd: i32,
    /// `POLLIN`/`POLLOUT` bits.
    pub events: i16,
}

pub use crate::envvar::{timeout_in, DEFAULT_TIMEOUT};

/// Waiting policy of a communicator.
#[derive(Clone, Debug)]
pub struct Waiter {
    /// Busy-poll this long after the last progress.
    pub spin: Duration,
    /// Then `sched_yield` this long.
    pub yield_for: Duration,
    /// Give up after this long without progress.
    pub timeout: Duration,
    /// Longest single sleep on a shared-memory counter before looking at the peers again
    /// (a peer's publish wakes the sleeper earlier). 10 ms.
    pub nap: Duration,
    /// Spin and yield times were set by the user; [`Waiter::fit`] leaves them alone.
    pub fixed: bool,
}

impl Default for Waiter {
    /// Spin 50 µs, yield 200 µs, then sleep; 300 s without progress is an error.
    fn default() -> Self {
        Waiter::from_lookup(&crate::envvar::unset).expect("the defaults parse")
    }
}

impl Waiter {
    /// Policy from `ROCCL_SPIN_US`, `ROCCL_YIELD_US`, `ROCCL_TIMEOUT` as `get` gives them;
    /// a value that does not parse is an error naming it.
    pub fn from_lookup(get: crate::envvar::Lookup<'_>) -> crate::error::Result<Self> {
        let us = |k: &str, d: u64| crate::envvar::value_in(get, k, d).map(Duration::from_micros);
        Ok(Waiter {
            spin: us("ROCCL_SPIN_US", 50)?,
            yield_for: us("ROCCL_YIELD_US", 200)?,
            timeout: timeout_in(get)?,
            nap: Duration::from_millis(10),
            fixed: crate::envvar::raw_in(get, "ROCCL_SPIN_US").is_some()
                || crate::envvar::raw_in(get, "ROCCL_YIELD_US").is_some(),
        })
    }

    /// Adapt to the machine. With more ranks on this host than cores, a spinning rank
    /// steals the core a peer needs, so skip spinning and yield instead (measured on 2 cores,
    /// 4 ranks, 8 B all-reduce: spin-then-block ≈ 200-250 µs, yield ≈ 70-110 µs). With a
    /// core per rank, spin up to 1 ms: a rank that sleeps between two pieces of a transfer
    /// is woken on its peer's core by the kernel, and two ranks sharing one core halve the
    /// bandwidth (2 ranks, 2 MiB: 1.4 GB/s sleeping vs 4.4 GB/s spinning; docs/PERFORMANCE-LOG.md).
    pub fn fit(&mut self, local_ranks: usize, cores: usize) {
        if self.fixed {
            return;
        }
        if local_ranks > cores {
            self.spin = Duration::ZERO;
            self.yield_for = Duration::from_millis(2);
        } else {
            self.spin = Duration::from_millis(1);
        }
    }

    /// Spin at least [`SPIN_LATENCIES`] one-way latencies of the slowest link between hosts
    /// (`alpha`, measured at init), at most [`SPIN_MAX`], counting from the spin fitted to
    /// the host (the caller resets it first): a call waits about two of them, so
    /// over a slow link (a VM's software RoCE: 150-300 µs one way, 2026-12-07) the fixed
    /// 1 ms spin ran out inside ordinary calls and they slept, and a wake-up there costs
    /// milliseconds. Left alone when the user set the times, or when ranks share cores (no
    /// spin phase: a spinning rank would take a peer's core).
    pub fn fit_latency(&mut self, alpha: Duration) {
        if self.fixed || self.spin.is_zero() {
            return;
        }
        self.spin = self.spin.max((alpha * SPIN_LATENCIES).min(SPIN_MAX));
    }

    /// Begin waiting for something.
    pub fn start(&self) -> WaitState<'_> {
        WaitState {
            w: self,
            last: None,
            spins: 0,
            next_yield: YIELD_EVERY,
        }
    }
}

/// One-way latencies of the slowest link a wait spins at least ([`Waiter::fit_latency`]).
pub const SPIN_LATENCIES: u32 = 16;
/// The longest spin [`Waiter::fit_latency`] sets: past it, a wait sleeps whatever the link.
pub const SPIN_MAX: Duration = Duration::from_millis(20);

/// One wait in progress.
pub struct WaitState<'a> {
    w: &'a Waiter,
    /// When the idle stretch began: read from the clock only once the first spins are over
    /// (a collective that completes at once never reads it).
    last: Option<Instant>,
    spins: u32,
    /// When (time idle) the spin phase next gives way to other runnable threads.
    next_yield: Duration,
}

/// How often a spinning wait calls `sched_yield`: when nothing else wants its core the call
/// returns at once (about 0.3 µs per 20 µs of spinning); when something does (the peer rank
/// scheduled on this core, a compile, torch's threads), that gets the core instead of
/// waiting for the end of this thread's time slice, which cost an 8-byte torch all-reduce
/// about 1 ms with a busy process beside the 2 ranks on 2 cores (docs/PERFORMANCE-LOG.md).
const YIELD_EVERY: Duration = Duration::from_micros(20);

/// The wait ran past the timeout.
#[derive(Debug)]
pub struct TimedOut(pub Duration);

impl WaitState<'_> {
    /// Something moved: restart the spin phase.
    pub fn progressed(&mut self) {
        self.spins = 0;
        self.last = None;
        self.next_yield = YIELD_EVERY;
    }

    /// Whether the next [`WaitState::idle`] would block in `poll(2)` (so the caller collects
    /// descriptors only then: networks may arm wake-ups when asked for them).
    pub fn will_block(&self) -> bool {
        self.spins + 1 >= 16
            && self
                .last
                .is_some_and(|t| t.elapsed() >= self.w.spin + self.w.yield_for)
    }

    /// Nothing moved in the last pass: spin or yield, or say that it is time to block
    /// (`Ok(true)`; the caller sleeps its own way, e.g. in futex(2), and calls again).
    /// Errors once the timeout has passed without progress.
    pub fn pause(&mut self) -> Result<bool, TimedOut> {
        self.spins += 1;
        // Sharing cores (no spin phase): the peer we wait for may need this very core, and
        // a PAUSE costs ~40 ns on recent x86: yield at once.
        if self.w.spin.is_zero() && self.spins < 16 {
            std::thread::yield_now();
            return Ok(false);
        }
        // Read the clock only every few spins: it costs more than a poll pass of TCP.
        if self.spins < 16 {
            std::hint::spin_loop();
            return Ok(false);
        }
        self.spins = 8;
        let idle = self.last.get_or_insert_with(Instant::now).elapsed();
        if idle < self.w.spin {
            if idle >= self.next_yield {
                self.next_yield = idle + YIELD_EVERY;
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(false);
        }
        if idle >= self.w.timeout {
            return Err(TimedOut(idle));
        }
        if idle < self.w.spin + self.w.yield_for {
            std::thread::yield_now();
            return Ok(false);
        }
        Ok(true)
    }

    /// Nothing moved in the last pass: spin, yield or block on `fds`, then return so the
    /// caller polls again; `Ok(true)` when it slept in `poll(2)`. Errors once the timeout
    /// has passed without progress.
    pub fn idle(&mut self, fds: &[PollFd]) -> Result<bool, TimedOut> {
        if !self.pause()? {
            return Ok(false);
        }
        let idle = self.last.map_or(Duration::ZERO, |t| t.elapsed());
        let left = self.w.timeout.saturating_sub(idle);
        let ms = left.as_millis().clamp(1, 20) as i32;
        if fds.is_empty() {
            std::thread::sleep(Duration::from_micros(50));
            return Ok(true);
        }
        let pollfd = |f: &PollFd| libc::pollfd {
            fd: f.fd,
            events: f.events,
            revents: 0,
        };
        // On the stack for the usual few connections; no allocation per wait.
        let mut small = arrayvec::ArrayVec::<libc::pollfd, 64>::new();
        let mut large = Vec::new();
        let pfds: &mut [libc::pollfd] = if fds.len() <= small.capacity() {
            small.extend(fds.iter().map(pollfd));
            &mut small
        } else {
            large.extend(fds.iter().map(pollfd));
            &mut large
        };
        // SAFETY: `pfds` is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::envvar::pairs as with;

    #[test]
    fn the_policy_comes_from_the_settings_given() {
        let w = Waiter::from_lookup(&with(&[("ROCCL_SPIN_US", "7"), ("ROCCL_TIMEOUT", "2.5")]))
            .unwrap();
        assert_eq!(w.spin, Duration::from_micros(7));
        assert_eq!(w.yield_for, Duration::from_micros(200));
        assert_eq!(w.timeout, Duration::from_millis(2500));
        assert!(w.fixed);
        let d = Waiter::default();
        assert_eq!(
            (d.spin, d.timeout, d.fixed),
            (Duration::from_micros(50), DEFAULT_TIMEOUT, false)
        );
    }

    #[test]
    fn a_bad_value_is_an_error_naming_it() {
        for (k, v) in [("ROCCL_SPIN_US", "soon"), ("ROCCL_TIMEOUT", "never")] {
            let get = move |n: &str| (n == k).then(|| v.to_string());
            let e = Waiter::from_lookup(&get).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{e}");
        }
    }

    /// The spin stretches to 16 one-way latencies of a slow link, capped at 20 ms; a fast
    /// link, times the user set, and ranks sharing cores (no spin) leave it alone.
    #[test]
    fn slow_links_stretch_the_spin() {
        let ms = Duration::from_millis;
        let mut w = Waiter::default();
        w.fit(1, 2);
        assert_eq!(w.spin, ms(1));
        w.fit_latency(Duration::from_micros(5));
        assert_eq!(w.spin, ms(1), "a fast link");
        w.fit_latency(Duration::from_micros(300));
        assert_eq!(w.spin, Duration::from_micros(4800));
        w.fit_latency(ms(50));
        assert_eq!(w.spin, SPIN_MAX);
        let mut shared = Waiter::default();
        shared.fit(4, 2);
        shared.fit_latency(ms(1));
        assert!(
            shared.spin.is_zero(),
            "ranks sharing cores spin {:?}",
            shared.spin
        );
        let mut set = Waiter::from_lookup(&with(&[("ROCCL_SPIN_US", "7")])).unwrap();
        set.fit_latency(ms(1));
        assert_eq!(set.spin, Duration::from_micros(7), "ROCCL_SPIN_US=7 kept");
    }
}
