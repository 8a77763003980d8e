//! The link model of the simulated network: the cluster's shape (`ROCCL_SIM`), virtual
//! clocks, and the serialising queues of its links.
//!
//! Times are integer picoseconds (`u64`: 213 days), so that every rank computes the same
//! arrival for the same history, whatever its thread's floating-point state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Picoseconds per microsecond.
const PS_PER_US: f64 = 1e6;

/// The shape and speeds of the simulated cluster (`ROCCL_SIM`, comma-separated
/// `name=value`). Ranks sit on hosts in rank order: rank `r` on host `r / ranks_per_host`.
#[derive(Clone, Debug, PartialEq)]
pub struct SimSpec {
    /// Hosts (`hosts`); `None`: as many as the ranks need. A rank beyond
    /// `hosts × ranks_per_host` is refused.
    pub hosts: Option<usize>,
    /// Ranks per host (`ranks_per_host`, default 8).
    pub ranks_per_host: usize,
    /// NICs per host (`nics`, default 1): the rank of local index `i` sends and receives
    /// through NIC `i % nics` (one NIC per GPU, as on rail-optimised clusters, with
    /// `nics=ranks_per_host`).
    pub nics: usize,
    /// Each NIC, each direction, in Gbit/s (`nic_gbps`, default 100).
    pub nic_gbps: f64,
    /// One-way latency between hosts in µs (`nic_us`, default 2).
    pub nic_us: f64,
    /// Each rank's link to the other ranks of its host, each direction, in Gbit/s
    /// (`local_gbps`, default 200).
    pub local_gbps: f64,
    /// One-way latency inside a host in µs (`local_us`, default 0.5).
    pub local_us: f64,
    /// Software overhead per message in µs, charged to the sender when it posts and to the
    /// receiver when it completes (`msg_us`, default 0.5).
    pub msg_us: f64,
    /// Reduction speed in GB/s of output (`reduce_gbs`; default 0: reductions take no time).
    pub reduce_gbs: f64,
    /// Whether messages carry their bytes (`data`, default 1). With `data=0` messages over
    /// 64 KiB move no bytes, only lengths, tags and virtual times, so that sizes whose
    /// buffers and queues would not fit in memory can be timed; what ranks receive is then
    /// not the data sent, and a tool must not check it.
    pub data: bool,
}

impl Default for SimSpec {
    fn default() -> Self {
        SimSpec {
            hosts: None,
            ranks_per_host: 8,
            nics: 1,
            nic_gbps: 100.0,
            nic_us: 2.0,
            local_gbps: 200.0,
            local_us: 0.5,
            msg_us: 0.5,
            reduce_gbs: 0.0,
            data: true,
        }
    }
}

/// The names `ROCCL_SIM` takes, for errors and `--help`.
pub const SIM_KEYS: &str =
    "hosts, ranks_per_host, nics, nic_gbps, nic_us, local_gbps, local_us, msg_us, reduce_gbs, data";

impl std::str::FromStr for SimSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<SimSpec> {
        let mut spec = SimSpec::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return Err(Error::arg(format!(
                    "ROCCL_SIM: '{part}' is not name=value (names: {SIM_KEYS})"
                )));
            };
            let (k, v) = (k.trim(), v.trim());
            let num = |min: f64| -> Result<f64> {
                match v.parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= min => Ok(x),
                    _ => Err(Error::arg(format!(
                        "ROCCL_SIM: {k}={v} is not a number of at least {min}"
                    ))),
                }
            };
            let count = || -> Result<usize> {
                match v.parse::<usize>() {
                    Ok(x) if x >= 1 => Ok(x),
                    _ => Err(Error::arg(format!(
                        "ROCCL_SIM: {k}={v} is not a whole number of at least 1"
                    ))),
                }
            };
            match k {
                "hosts" => spec.hosts = Some(count()?),
                "ranks_per_host" => spec.ranks_per_host = count()?,
                "nics" => spec.nics = count()?,
                "nic_gbps" => spec.nic_gbps = num(1e-3)?,
                "nic_us" => spec.nic_us = num(0.0)?,
                "local_gbps" => spec.local_gbps = num(1e-3)?,
                "local_us" => spec.local_us = num(0.0)?,
                "msg_us" => spec.msg_us = num(0.0)?,
                "reduce_gbs" => spec.reduce_gbs = num(0.0)?,
                "data" => {
                    spec.data = match v {
                        "1" => true,
                        "0" => false,
                        _ => {
                            return Err(Error::arg(format!(
                                "ROCCL_SIM: data={v}: expected 1 (messages carry their bytes) or 0 (lengths and times only)"
                            )))
                        }
                    }
                }
                other => {
                    return Err(Error::arg(format!(
                        "ROCCL_SIM: unknown name '{other}' (names: {SIM_KEYS})"
                    )))
                }
            }
        }
        Ok(spec)
    }
}

impl std::fmt::Display for SimSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(h) = self.hosts {
            write!(f, "hosts={h},")?;
        }
        write!(
            f,
            "ranks_per_host={},nics={},nic_gbps={},nic_us={},local_gbps={},local_us={},msg_us={},reduce_gbs={}",
            self.ranks_per_host,
            self.nics,
            self.nic_gbps,
            self.nic_us,
            self.local_gbps,
            self.local_us,
            self.msg_us,
            self.reduce_gbs
        )?;
        if !self.data {
            write!(f, ",data=0")?;
        }
        Ok(())
    }
}

impl SimSpec {
    /// The host of `rank`, or an error when the cluster is too small for it.
    pub fn host_of(&self, rank: usize) -> Result<usize> {
        let h = rank / self.ranks_per_host;
        match self.hosts {
            Some(hosts) if h >= hosts => Err(Error::arg(format!(
                "ROCCL_SIM: rank {rank} does not fit on {hosts} hosts of {} ranks: raise hosts= or ranks_per_host=, or leave hosts= out",
                self.ranks_per_host
            ))),
            _ => Ok(h),
        }
    }

    /// The NIC of `rank` on its host (`host_of`): its local index modulo `nics`.
    pub fn nic_of(&self, rank: usize) -> usize {
        (rank % self.ranks_per_host) % self.nics
    }

    /// Per-message software overhead, ps.
    pub(crate) fn msg_ps(&self) -> u64 {
        (self.msg_us * PS_PER_US) as u64
    }

    /// Latency and picoseconds per byte of the link between two hosts, or inside one.
    pub(crate) fn link(&self, same_host: bool) -> (u64, f64) {
        let (us, gbps) = if same_host {
            (self.local_us, self.local_gbps)
        } else {
            (self.nic_us, self.nic_gbps)
        };
        // 1 Gbit/s = 1 bit per ns = 8000 ps per byte.
        ((us * PS_PER_US) as u64, 8000.0 / gbps)
    }
}

/// Lanes of a clock: the most independent pipelines (a call's channels or trees, each a
/// state machine of the executor) a rank runs at once.
pub const LANES: usize = 8;

/// A virtual clock: one per simulated rank, with a lane per state machine of the call in
/// progress. A rank interleaves its machines (a ring's channels, the two trees) in real
/// time in whatever order its thread meets their messages; on a cluster they progress side
/// by side (a GPU block each). So each machine moves its own lane — what it sends is stamped
/// with its lane, what it takes moves its lane — and a call starts every lane at the rank's
/// time and ends at the latest lane. Only the rank's own threads move it (its calls are
/// serialised by the communicator), others read it.
#[derive(Debug, Default)]
pub struct Clock {
    lanes: [AtomicU64; LANES],
    /// Per lane, the stamp of its last send (a lane posts its sends in order).
    sends: [AtomicU64; LANES],
    /// When the bytes of the next send are ready (`Clock::ready_for_send`).
    ready: AtomicU64,
    lane: AtomicU64,
    call_start: AtomicU64,
    last_call: AtomicU64,
    /// Picoseconds per reduced byte (0: free).
    reduce_ps_per_byte: AtomicU64,
    /// Software overhead of a message, ps.
    msg_ps: AtomicU64,
}

impl Clock {
    /// The current virtual time (the latest lane).
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.latest() / 1000)
    }

    /// Set the clock (a tool aligning every rank before it times calls).
    pub fn set(&self, t: Duration) {
        self.set_all(t.as_nanos() as u64 * 1000);
    }

    /// The virtual time of this rank's last call (from [`Clock::call_started`] to
    /// [`Clock::call_done`]).
    pub fn last_call(&self) -> Duration {
        Duration::from_nanos(self.last_call.load(Ordering::Relaxed) / 1000)
    }

    /// A call begins: every lane at the rank's time, lane 0 current.
    pub fn call_started(&self) {
        let t = self.latest();
        self.set_all(t);
        self.lane.store(0, Ordering::Relaxed);
        self.call_start.store(t, Ordering::Relaxed);
    }

    /// A call ended, when its latest lane did.
    pub fn call_done(&self) {
        let t = self.latest();
        self.set_all(t);
        let d = t.saturating_sub(self.call_start.load(Ordering::Relaxed));
        self.last_call.store(d, Ordering::Relaxed);
    }

    /// The state machine `i` of the call runs now: what follows moves its lane.
    pub fn use_lane(&self, i: usize) {
        self.lane.store((i % LANES) as u64, Ordering::Relaxed);
    }

    /// The rank uses a message that arrived at `arrival` (ps; from
    /// [`RecvComm::virtual_arrival`](crate::net::RecvComm::virtual_arrival)): the lane
    /// moves there if it is behind, then by the message's software overhead. Returns when
    /// its bytes are ready (the arrival and the overhead).
    pub fn received(&self, arrival: u64) -> u64 {
        let o = self.msg_ps.load(Ordering::Relaxed);
        self.advance_to(arrival);
        self.add(o);
        arrival + o
    }

    /// The bytes of the next send on the current lane are ready at `t` (ps).
    pub fn ready_for_send(&self, t: u64) {
        self.ready.store(t, Ordering::Relaxed);
    }

    /// The stamp of a send posted now on the current lane: after the lane's previous send
    /// and once its bytes are ready, plus the software overhead. The lane moves there.
    pub(crate) fn send_stamp(&self) -> u64 {
        let lane = self.lane.load(Ordering::Relaxed) as usize % LANES;
        let ready = self.ready.swap(0, Ordering::Relaxed);
        let prev = self.sends[lane].load(Ordering::Relaxed);
        let stamp = prev.max(ready) + self.msg_ps.load(Ordering::Relaxed);
        self.sends[lane].store(stamp, Ordering::Relaxed);
        self.lanes[lane].fetch_max(stamp, Ordering::Relaxed);
        stamp
    }

    /// The rank waited for everything it had in flight: the current lane's next send
    /// leaves no earlier than the lane's time.
    pub fn waited(&self) {
        let lane = self.lane.load(Ordering::Relaxed) as usize % LANES;
        let now = self.lanes[lane].load(Ordering::Relaxed);
        self.sends[lane].fetch_max(now, Ordering::Relaxed);
    }

    /// The time to reduce `bytes` of output at the model's speed, ps.
    pub fn reduce_ps(&self, bytes: usize) -> u64 {
        self.reduce_ps_per_byte.load(Ordering::Relaxed) * bytes as u64
    }

    pub(crate) fn set_msg_ps(&self, ps: u64) {
        self.msg_ps.store(ps, Ordering::Relaxed);
    }

    pub(crate) fn set_reduce_speed(&self, gbs: f64) {
        // 1 GB/s = 1 byte per ns = 1000 ps per byte.
        let per = if gbs > 0.0 { (1000.0 / gbs) as u64 } else { 0 };
        self.reduce_ps_per_byte
            .store(per.max(u64::from(gbs > 0.0)), Ordering::Relaxed);
    }

    fn current(&self) -> &AtomicU64 {
        &self.lanes[self.lane.load(Ordering::Relaxed) as usize % LANES]
    }

    fn latest(&self) -> u64 {
        self.lanes
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }

    fn set_all(&self, t: u64) {
        for l in self.lanes.iter().chain(&self.sends) {
            l.store(t, Ordering::Relaxed);
        }
    }

    /// Move the current lane forward by `d` ps; its new time.
    pub(crate) fn add(&self, d: u64) -> u64 {
        self.current().fetch_add(d, Ordering::Relaxed) + d
    }

    /// Move the current lane to `t` if it is behind.
    pub fn advance_to(&self, t: u64) {
        self.current().fetch_max(t, Ordering::Relaxed);
    }
}

/// One direction of a link: the intervals it is busy, in virtual time. A message takes the
/// first gap at or after the moment it is ready that fits its serialisation time, so a
/// message stamped earlier in virtual time that a thread posts later in real time still
/// finds the link free where it was (the ranks' threads do not run in virtual-time order).
#[derive(Debug, Default)]
pub(crate) struct Calendar {
    /// Sorted, disjoint, touching intervals merged: (start, end) in ps.
    busy: Vec<(u64, u64)>,
}

/// Intervals a calendar keeps: beyond, the oldest are forgotten (their time counts as free
/// to a message stamped that early, which only a rank far behind the others posts).
const CALENDAR_KEEP: usize = 256;

impl Calendar {
    /// Book `dur` ps at or after `earliest`; the start.
    pub(crate) fn book(&mut self, earliest: u64, dur: u64) -> u64 {
        if dur == 0 {
            return earliest;
        }
        let mut i = self.busy.partition_point(|iv| iv.1 <= earliest);
        let mut t = earliest;
        while i < self.busy.len() {
            let (s, e) = self.busy[i];
            if t + dur <= s {
                break;
            }
            t = t.max(e);
            i += 1;
        }
        // Insert (t, t + dur) before index i, merging with touching neighbours.
        let end = t + dur;
        let joins_prev = i > 0 && self.busy[i - 1].1 == t;
        let joins_next = i < self.busy.len() && self.busy[i].0 == end;
        match (joins_prev, joins_next) {
            (true, true) => {
                self.busy[i - 1].1 = self.busy[i].1;
                self.busy.remove(i);
            }
            (true, false) => self.busy[i - 1].1 = end,
            (false, true) => self.busy[i].0 = t,
            (false, false) => self.busy.insert(i, (t, end)),
        }
        if self.busy.len() > CALENDAR_KEEP {
            self.busy.remove(0);
        }
        t
    }
}

/// A port: the two directions of a NIC (per host) or of a rank's link inside its host.
#[derive(Debug, Default)]
pub(crate) struct Port {
    pub tx: Mutex<Calendar>,
    pub rx: Mutex<Calendar>,
}

/// When a message of `bytes` posted at `stamp` on `from` arrives at `to`, over a link of
/// `latency` ps and `ps_per_byte`: it takes the sender's port for its serialisation time,
/// travels, and takes the receiver's port for as long (two messages arriving at one port
/// queue behind each other).
pub(crate) fn arrival(
    stamp: u64,
    bytes: usize,
    (latency, ps_per_byte): (u64, f64),
    from: &Port,
    to: &Port,
) -> u64 {
    let dur = (bytes as f64 * ps_per_byte) as u64;
    let start = from.tx.lock().book(stamp, dur);
    let rx = to.rx.lock().book(start + latency, dur);
    rx + dur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_every_name_and_refuses_others() {
        let s: SimSpec =
            "hosts=128,ranks_per_host=8,nics=4,nic_gbps=100,nic_us=2,local_gbps=200,local_us=0.5,msg_us=1,reduce_gbs=20"
                .parse()
                .unwrap();
        assert_eq!(s.hosts, Some(128));
        assert_eq!(s.ranks_per_host, 8);
        assert_eq!(s.nics, 4);
        // Local index 5 on host 1 uses NIC 5 mod 4.
        assert_eq!((s.host_of(13).unwrap(), s.nic_of(13)), (1, 1));
        assert_eq!(s.msg_us, 1.0);
        assert_eq!(s.reduce_gbs, 20.0);
        assert_eq!(s.to_string().parse::<SimSpec>().unwrap(), s);
        let e = "nic_gbs=1".parse::<SimSpec>().unwrap_err().to_string();
        assert!(
            e.contains("unknown name 'nic_gbs'") && e.contains("nic_gbps"),
            "{e}"
        );
        let e = "ranks_per_host=0"
            .parse::<SimSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("ranks_per_host=0"), "{e}");
        let s: SimSpec = "hosts=2,ranks_per_host=4".parse().unwrap();
        assert_eq!(s.host_of(7).unwrap(), 1);
        let e = s.host_of(8).unwrap_err().to_string();
        assert!(e.contains("rank 8 does not fit on 2 hosts"), "{e}");
        let s: SimSpec = "data=0".parse().unwrap();
        assert!(!s.data && SimSpec::default().data);
        assert_eq!(s.to_string().parse::<SimSpec>().unwrap(), s);
        let e = "data=yes".parse::<SimSpec>().unwrap_err().to_string();
        assert!(e.contains("data=yes"), "{e}");
    }

    #[test]
    fn each_machine_moves_its_own_lane_and_a_call_ends_with_the_latest() {
        let c = Clock::default();
        c.set_msg_ps(500);
        c.set(Duration::from_nanos(10));
        c.call_started();
        c.use_lane(1);
        assert_eq!(c.received(50_000), 50_500, "ready after the overhead");
        c.use_lane(0);
        assert_eq!(c.add(0), 10_000, "lane 0 did not move with lane 1");
        // A send whose bytes were ready at 15 ns leaves then, after lane 0's last send.
        c.ready_for_send(15_000);
        assert_eq!(c.send_stamp(), 15_500);
        assert_eq!(c.send_stamp(), 16_000, "a lane posts its sends in order");
        c.received(20_000);
        assert_eq!(c.now(), Duration::from_nanos(50));
        c.call_done();
        assert_eq!(c.last_call(), Duration::from_nanos(40));
        c.call_started();
        assert_eq!(
            c.add(0),
            50_500,
            "the next call starts every lane at the latest"
        );
        assert_eq!(c.send_stamp(), 51_000, "and every lane's sends");
    }

    #[test]
    fn a_calendar_serialises_and_fills_gaps() {
        let mut c = Calendar::default();
        assert_eq!(c.book(0, 10), 0);
        assert_eq!(c.book(0, 10), 10, "queued behind the first");
        assert_eq!(c.book(100, 10), 100);
        // Posted later in real time, stamped earlier: fits the gap 20..100.
        assert_eq!(c.book(30, 50), 30);
        assert_eq!(c.book(30, 50), 110, "no gap of 50 left before 110");
        assert_eq!(c.busy, vec![(0, 20), (30, 80), (100, 160)]);
        assert_eq!(c.book(5, 0), 5, "an empty message takes no time");
        for k in 0..1000 {
            c.book(1000 + 20 * k, 10);
        }
        assert!(c.busy.len() <= CALENDAR_KEEP);
    }

    #[test]
    fn arrival_adds_latency_and_serialisation_and_queues_incast() {
        let (a, b, c) = (Port::default(), Port::default(), Port::default());
        // 1 byte = 8 ps (1000 Gbit/s), latency 1000 ps.
        let link = (1000, 8.0);
        assert_eq!(arrival(0, 100, link, &a, &c), 1800);
        // b sends to c at the same moment: c's port receives it after a's.
        assert_eq!(arrival(0, 100, link, &b, &c), 2600);
        // a's port is busy until 800: a second message from a leaves then.
        assert_eq!(arrival(0, 100, link, &a, &b), 2600);
    }
}
