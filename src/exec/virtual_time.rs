//! Virtual time of a call on the simulated network (`net::sim`): when each piece of data the
//! call wrote is ready, so that a send is stamped when its own bytes were ready — not later
//! because the rank's thread happened to take other messages first in real time (an
//! algorithm takes every receive that has completed before it posts the sends that follow,
//! and a thread that runs late finds several completed at once).

use super::{Exec, MAX_OPS};

/// Byte ranges (address, length) written during the call and when they were ready (ps).
#[derive(Default)]
pub(crate) struct Ready {
    writes: arrayvec::ArrayVec<(usize, usize, u64), 64>,
}

impl Ready {
    /// When `m` was ready: the latest write that overlaps it (0: before the call).
    fn at(&self, m: (usize, usize)) -> u64 {
        self.writes
            .iter()
            .filter(|w| w.0 < m.0 + m.1 && m.0 < w.0 + w.1)
            .map(|w| w.2)
            .max()
            .unwrap_or(0)
    }

    fn wrote(&mut self, m: (usize, usize), t: u64) {
        if self.writes.is_full() {
            self.writes.remove(0);
        }
        self.writes.push((m.0, m.1, t));
    }
}

impl Exec<'_> {
    /// State machine `i` of the call runs now (the clock keeps a lane per machine).
    pub fn use_lane(&mut self, i: usize) {
        if let Some(c) = &self.links.clock {
            c.use_lane(i);
        }
    }

    /// The algorithm took receive `i`: the rank sees the message now, and its bytes are
    /// ready from its arrival on.
    pub(super) fn sim_took(&mut self, i: usize) {
        let o = &mut self.ops[i];
        let a = std::mem::take(&mut o.arrival);
        if let (Some(c), 1..) = (&self.links.clock, a) {
            self.ready.wrote((o.addr, o.len), c.received(a));
        }
    }

    /// A send of `m` is about to be posted: it leaves once its bytes are ready.
    pub(super) fn sim_before_send(&self, m: (usize, usize)) {
        if let Some(c) = &self.links.clock {
            c.ready_for_send(self.ready.at(m));
        }
    }

    /// `d = a op b`: ready when both inputs are, plus the reduction's time.
    pub(super) fn sim_reduced(&mut self, d: (usize, usize), a: (usize, usize), b: (usize, usize)) {
        if let Some(c) = &self.links.clock {
            let t = self.ready.at(a).max(self.ready.at(b)) + c.reduce_ps(d.1);
            c.advance_to(t);
            self.ready.wrote(d, t);
        }
    }

    /// `d = s`: ready when `s` is.
    pub(super) fn sim_copied(&mut self, d: (usize, usize), s: (usize, usize)) {
        if self.links.clock.is_some() {
            let t = self.ready.at(s);
            self.ready.wrote(d, t);
        }
    }

    /// Every request of the call completed (the algorithm waited for all of them): the
    /// receives it did not take are seen now, in virtual order, their bytes ready from then;
    /// and what the lane sends next leaves no earlier than the latest of them.
    pub(super) fn sim_waited_all(&mut self) {
        let Some(c) = &self.links.clock else {
            return;
        };
        let mut arrivals = arrayvec::ArrayVec::<(u64, usize), MAX_OPS>::new();
        for (i, o) in self.ops.iter_mut().enumerate() {
            if o.active && o.done && o.arrival > 0 {
                arrivals.push((std::mem::take(&mut o.arrival), i));
            }
        }
        arrivals.sort_unstable();
        for (a, i) in arrivals {
            let m = (self.ops[i].addr, self.ops[i].len);
            self.ready.wrote(m, c.received(a));
        }
        c.waited();
    }
}
