//! The links between hosts, measured at init (`ROCCL_MEASURE`, [`Config::measure_links`]).
//!
//! A NIC's advertised speed says little about a `thunderbolt-net` link, a shaped port or a
//! loaded host, so on a job of several hosts one rank of each host (its first) measures the
//! link to the first rank of every other host through the communicator itself, as calls
//! will use it: one exchange that meets the peer (and opens the connection), then
//! [`PINGS`] round trips of 8 bytes (latency: half the fastest round trip: a link is never
//! faster than it is, while a loaded host only ever adds to a round trip), bursts from
//! [`BURST_FIRST`] bytes doubling until one lasts [`BURST_TIME`] (at most [`BURST_MAX`]), then
//! [`BURSTS`] bursts of that size, each answered by 8 bytes (bandwidth: the bytes over the
//! fastest burst's time less one round trip). Pairs run in rounds where no host is in two pairs, so a
//! measurement never shares its rank with another. Every rank then takes the same table,
//! merged by an all-reduce (each cell is written by one rank, the others hold zero), and
//! the cost model takes the slowest pair's latency and bandwidth for the links between
//! hosts: every rank decides from the same numbers.
//!
//! Where ranks offer several networks (`ROCCL_NETS`, [`Config::extra_nets`]), the first
//! ranks of each pair of hosts measure each network both offer (a lane), and every pair of
//! ranks on those hosts takes, for a collective of `s` bytes, the lane of least `α + s/β`
//! among those both ranks have ([`choose_by_size`]): the choice is the same at both ends, since the table and the
//! call's size are. The cost model then takes, per pair, the best latency and the best
//! bandwidth of its lanes.
//!
//! [`Config::extra_nets`]: super::Config::extra_nets
//! [`Config::measure_links`]: super::Config::measure_links

use std::time::{Duration, Instant};

use super::config::EXTRA_NETS;
use super::{Communicator, State};
use crate::error::Result;
use crate::exec::links::MAX_LANES;
use crate::types::RedOp;

/// Timed round trips of 8 bytes per pair (the fastest counts: on a loaded host most of them
/// wait for a core, and 16 leave a few that did not).
pub const PINGS: usize = 16;
/// Bytes of the first burst; each next one doubles until a burst takes [`BURST_TIME`] or
/// reaches [`BURST_MAX`] (a burst much shorter than the host's scheduling noise measures the
/// noise: a fast link gets large bursts, a slow one small).
pub const BURST_FIRST: usize = 256 << 10;
/// The largest burst.
pub const BURST_MAX: usize = 8 << 20;
/// A burst this long measures the link rather than the scheduler.
pub const BURST_TIME: Duration = Duration::from_millis(2);
/// Timed bursts per pair at the size found, the two that found it included (the fastest
/// counts).
pub const BURSTS: usize = 3;
/// Up to this many hosts every pair is measured; beyond, each host and the next in order.
const ALL_PAIRS_UP_TO: usize = 16;

/// A pair of hosts' network by call size: (the hosts, steps of (from this many bytes, the
/// network), ascending).
pub type NetChoice = ((usize, usize), Vec<(usize, &'static str)>);

/// A pair of hosts and its measured lanes: (lane, α µs, β GB/s).
type PairLanes = ((usize, usize), Vec<(u8, f64, f64)>);

/// One measured link between two hosts: one network between them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredLink {
    /// The hosts (in the order the job's topology numbers them), the lower first.
    pub hosts: (usize, usize),
    /// The ranks that measured it (each its host's first rank).
    pub ranks: (usize, usize),
    /// The network measured (the main one, or one of `ROCCL_NETS`).
    pub net: &'static str,
    /// Its lane: 0 for the main network, else 1 + its place in tcp, rocev2, verbs.
    pub lane: usize,
    /// Half the fastest of 16 round trips of an 8-byte message, in µs.
    pub alpha_us: f64,
    /// Bytes per second over the fastest burst, in GB/s.
    pub beta_gbs: f64,
}

/// What the job measured at init and what the cost model took from it.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredLinks {
    /// Every measured pair of hosts.
    pub links: Vec<MeasuredLink>,
    /// The latency (µs) and bandwidth (GB/s) the cost model takes for the links between
    /// hosts: the slowest pair's.
    pub model: (f64, f64),
    /// What the cost model had before (from the NICs' advertised figures).
    pub advertised: (f64, f64),
    /// Per pair of hosts with more than one network measured, the network that carries a
    /// collective from each size on: (from this many bytes, network), ascending.
    pub choices: Vec<NetChoice>,
}

impl MeasuredLinks {
    /// One line per link, for logs and tools.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "the cost model takes α={:.1}µs β={:.3}GB/s between hosts (advertised: α={:.1}µs β={:.3}GB/s)",
            self.model.0, self.model.1, self.advertised.0, self.advertised.1
        );
        for l in &self.links {
            s.push_str(&format!(
                "\n  hosts {}↔{} (ranks {}↔{}) over {}: α={:.1}µs β={:.3}GB/s",
                l.hosts.0, l.hosts.1, l.ranks.0, l.ranks.1, l.net, l.alpha_us, l.beta_gbs
            ));
        }
        for (hosts, steps) in &self.choices {
            s.push_str(&format!(
                "\n  hosts {}↔{}: {}",
                hosts.0,
                hosts.1,
                describe_steps(steps)
            ));
        }
        s
    }
}

/// A choice by size in words: `tcp below 64 KiB, rocev2 from 64 KiB`.
pub(crate) fn describe_steps(steps: &[(usize, &str)]) -> String {
    let mut out = Vec::new();
    for (i, &(from, net)) in steps.iter().enumerate() {
        let upto = steps.get(i + 1).map(|s| s.0);
        out.push(match (from, upto) {
            (0, None) => format!("{net} at every size"),
            (0, Some(u)) => format!("{net} below {}", crate::types::human_bytes(u)),
            (f, _) => format!("{net} from {}", crate::types::human_bytes(f)),
        });
    }
    out.join(", ")
}

/// The lane of least `α + s/β` for each size `s`, over `lanes` (lane, α µs, β GB/s), as
/// steps: (from this many bytes, lane), ascending, the first from 0. Ties go to the lower
/// lane (the main network first).
pub(crate) fn choose_by_size(lanes: &[(u8, f64, f64)]) -> Vec<(usize, u8)> {
    let usable: Vec<(u8, f64, f64)> = lanes
        .iter()
        .copied()
        .filter(|l| l.1 > 0.0 && l.2 > 0.0 && l.1.is_finite() && l.2.is_finite())
        .collect();
    // µs for `s` bytes: β GB/s moves 1000·β bytes per µs.
    let cost = |l: &(u8, f64, f64), s: f64| l.1 + s / (l.2 * 1e3);
    let best = |s: f64| {
        usable
            .iter()
            .min_by(|a, b| cost(a, s).total_cmp(&cost(b, s)).then(a.0.cmp(&b.0)))
            .map(|l| l.0)
    };
    // The best lane changes only where two lanes cost the same.
    let mut points = vec![0.0f64];
    for a in &usable {
        for b in &usable {
            let slope = 1.0 / (a.2 * 1e3) - 1.0 / (b.2 * 1e3);
            let s = (b.1 - a.1) / slope;
            if slope > 0.0 && s > 0.0 && s < 1e15 {
                points.push(s);
            }
        }
    }
    points.sort_by(f64::total_cmp);
    let mut steps: Vec<(usize, u8)> = Vec::new();
    for s in points {
        // Just past the point: the lane that wins from there.
        let from = s.ceil() as usize;
        let Some(lane) = best(from as f64 + 0.5) else {
            break;
        };
        if steps.last().map(|l| l.1) != Some(lane) {
            steps.push((if steps.is_empty() { 0 } else { from }, lane));
        }
    }
    steps
}

/// The pairs of hosts to measure: all of them up to [`ALL_PAIRS_UP_TO`] hosts, else each
/// host and the next.
fn pairs(hosts: usize) -> Vec<(usize, usize)> {
    if hosts <= ALL_PAIRS_UP_TO {
        (0..hosts)
            .flat_map(|a| (a + 1..hosts).map(move |b| (a, b)))
            .collect()
    } else {
        (0..hosts)
            .map(|a| {
                let b = (a + 1) % hosts;
                (a.min(b), a.max(b))
            })
            .collect()
    }
}

/// `pairs` in rounds where no host appears twice: each pair goes into the first round that
/// has neither of its hosts yet (the same on every rank).
fn rounds(pairs: &[(usize, usize)]) -> Vec<Vec<(usize, usize)>> {
    let mut rounds: Vec<Vec<(usize, usize)>> = Vec::new();
    for &(a, b) in pairs {
        let free = rounds
            .iter()
            .position(|r| r.iter().all(|&(x, y)| x != a && x != b && y != a && y != b));
        match free {
            Some(i) => rounds[i].push((a, b)),
            None => rounds.push(vec![(a, b)]),
        }
    }
    rounds
}

/// Latency (µs) and bandwidth (GB/s) from the round trips and the fastest burst.
fn figures(rtts: &[Duration], burst: Duration, bytes: usize) -> (f64, f64) {
    let rtt = rtts.iter().min().copied().unwrap_or_default();
    // The burst's time holds one round trip (its first byte out, the answer back); at
    // least half of it is the bytes themselves, whatever the noise in the round trips.
    let moving = burst.saturating_sub(rtt).max(burst / 2);
    let beta = bytes as f64 / moving.as_secs_f64().max(1e-9) / 1e9;
    (rtt.as_secs_f64() * 1e6 / 2.0, beta)
}

impl Communicator {
    /// The links between hosts as measured at init, and what the cost model took from them;
    /// `None` on a job of one host, or with [`Config::measure_links`] off.
    ///
    /// [`Config::measure_links`]: super::Config::measure_links
    pub fn measured_links(&self) -> Option<MeasuredLinks> {
        self.with_turn(|state| state.measured.clone())
    }

    /// How long a call's waits spin before they yield and sleep: `ROCCL_SPIN_US` if set,
    /// else fitted to the host (zero when ranks outnumber cores) and stretched to the links
    /// measured at init ([`Waiter::fit_latency`]).
    ///
    /// [`Waiter::fit_latency`]: crate::os::wait::Waiter::fit_latency
    pub fn wait_spin(&self) -> Duration {
        self.with_turn(|state| state.cfg.waiter.spin)
    }

    /// Decide from `links` as from a table measured at init: the cost model's figures and
    /// each peer's network by call size. Every rank must pass the same table (a
    /// measurement made elsewhere, or a test's); a call issued after it on every rank runs
    /// as it chooses.
    pub fn set_measured_links(&self, links: Vec<MeasuredLink>) -> MeasuredLinks {
        self.with_turn(|state| state.take_measured(links))
    }

    /// Measure the links between hosts (see the module), share the table and hand it to the
    /// cost model and the choice of network. Every rank of a job of several hosts calls it
    /// once, at init.
    pub(super) fn measure_links(&self) -> Result<()> {
        let topo = match self.with_turn(|state| state.topo.clone()) {
            Some(t) if t.nhosts() > 1 => t,
            _ => return Ok(()),
        };
        let (rank, hosts) = (self.rank(), topo.nhosts());
        let first = |h: usize| topo.at(h, 0).expect("every host has a rank");
        let all = pairs(hosts);
        // Two cells per measured pair and lane, in `all`'s order, then by lane.
        let cell = |pair: usize, lane: usize| 2 * (pair * MAX_LANES + lane);
        let mut table = vec![0f64; cell(all.len(), 0)];
        let my_host = topo.host_of(rank);
        let said = |e: &crate::error::Error| {
            crate::warn!(
                "rank {rank}: measuring the links between hosts at init failed ({e}); ROCCL_MEASURE=0 skips the measurement"
            )
        };
        if first(my_host) == rank {
            for round in rounds(&all) {
                let Some(&(a, b)) = round.iter().find(|&&(a, b)| a == my_host || b == my_host)
                else {
                    continue;
                };
                let at = all
                    .iter()
                    .position(|&p| p == (a, b))
                    .expect("a listed pair");
                let peer = first(if a == my_host { b } else { a });
                for lane in self.with_turn(|state| state.links.lanes.toward(peer)) {
                    if a == my_host {
                        let (alpha, beta) =
                            self.on_lane(lane, || self.probe(peer)).inspect_err(said)?;
                        table[cell(at, lane)] = alpha;
                        table[cell(at, lane) + 1] = beta;
                    } else {
                        self.on_lane(lane, || self.answer(peer)).inspect_err(said)?;
                    }
                }
            }
        }
        self.all_reduce_in_place(&mut table, RedOp::Max)
            .inspect_err(said)?;
        let main = self.with_turn(|state| state.links.endpoints[0].net.name());
        let mut links = Vec::new();
        for (i, &(a, b)) in all.iter().enumerate() {
            for lane in 0..MAX_LANES {
                let (alpha, beta) = (table[cell(i, lane)], table[cell(i, lane) + 1]);
                // A lane not measured (not offered by both) holds zeros; the main one is
                // listed whatever it holds, as it was before other lanes existed.
                if lane > 0 && alpha <= 0.0 {
                    continue;
                }
                links.push(MeasuredLink {
                    hosts: (a, b),
                    ranks: (first(a), first(b)),
                    net: if lane == 0 {
                        main
                    } else {
                        EXTRA_NETS[lane - 1].name()
                    },
                    lane,
                    alpha_us: alpha,
                    beta_gbs: beta,
                });
            }
        }
        let measured = self.with_turn(|state| state.take_measured(links));
        if rank == 0 {
            crate::info!(
                "rank 0: links measured at init (ROCCL_MEASURE): {}",
                measured.describe()
            );
        }
        Ok(())
    }

    /// `f` with point-to-point messages on lane `lane` (the network measured).
    fn on_lane<R>(&self, lane: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let set = |to: Option<u8>| self.with_turn(|state| state.links.lanes.forced = to);
        set(Some(lane as u8));
        let r = f();
        set(None);
        r
    }

    /// The measuring side of a pair: meet, round trips, bursts (each announced by its size
    /// in 8 bytes; a size of 0 ends the pair).
    fn probe(&self, peer: usize) -> Result<(f64, f64)> {
        let mut word = [0u8; 8];
        self.send(&word, peer)?;
        self.recv(&mut word, peer)?;
        let mut rtts = Vec::with_capacity(PINGS);
        for _ in 0..PINGS {
            let t = Instant::now();
            self.send(&word, peer)?;
            self.recv(&mut word, peer)?;
            rtts.push(t.elapsed());
        }
        let burst = vec![0u8; BURST_MAX];
        let timed = |size: usize| -> Result<Duration> {
            let mut ack = [0u8; 8];
            self.send(&(size as u64).to_le_bytes(), peer)?;
            let t = Instant::now();
            self.send(&burst[..size], peer)?;
            self.recv(&mut ack, peer)?;
            Ok(t.elapsed())
        };
        // Each size is timed twice (the faster counts): one burst the scheduler delayed
        // does not stop the doubling at a size that measures the delay.
        let mut size = BURST_FIRST;
        let mut fastest = timed(size)?.min(timed(size)?);
        while size < BURST_MAX && fastest < BURST_TIME {
            size = (2 * size).min(BURST_MAX);
            fastest = timed(size)?.min(timed(size)?);
        }
        for _ in 2..BURSTS {
            fastest = fastest.min(timed(size)?);
        }
        self.send(&0u64.to_le_bytes(), peer)?;
        Ok(figures(&rtts, fastest, size))
    }

    /// The answering side of a pair, in step with [`Communicator::probe`].
    fn answer(&self, peer: usize) -> Result<()> {
        let mut word = [0u8; 8];
        for _ in 0..=PINGS {
            self.recv(&mut word, peer)?;
            self.send(&word, peer)?;
        }
        let mut burst = vec![0u8; BURST_MAX];
        loop {
            self.recv(&mut word, peer)?;
            let size = u64::from_le_bytes(word);
            if size == 0 {
                return Ok(());
            }
            // A size the prober cannot have sent: the peer is not measuring as this rank is.
            let Some(buf) = usize::try_from(size).ok().and_then(|n| burst.get_mut(..n)) else {
                return Err(crate::error::Error::remote(
                    peer,
                    crate::error::PeerCause::Failed,
                    format!("measuring the link at init: a burst of {size} bytes announced, more than the {BURST_MAX} a rank sends (ranks of different roccl versions?)"),
                ));
            };
            self.recv(buf, peer)?;
            self.send(&word, peer)?;
        }
    }
}

impl State {
    /// Keep the measured `links`; give the cost model of the links between hosts (the
    /// flat calls' and the hierarchical calls' outer one) the slowest pair's figures — each
    /// pair's best latency and best bandwidth over its networks — each rank's share of the
    /// bandwidth scaled as the advertised figure was; and choose each peer's network by
    /// call size.
    fn take_measured(&mut self, links: Vec<MeasuredLink>) -> MeasuredLinks {
        let mut by_pair: Vec<PairLanes> = Vec::new();
        // A lane no network has (a table given to `set_measured_links`) is left out.
        for l in links.iter().filter(|l| l.lane < MAX_LANES) {
            let lane = (l.lane as u8, l.alpha_us, l.beta_gbs);
            match by_pair.iter_mut().find(|p| p.0 == l.hosts) {
                Some(p) => p.1.push(lane),
                None => by_pair.push((l.hosts, vec![lane])),
            }
        }
        let usable = |v: &(u8, f64, f64)| v.1 > 0.0 && v.2 > 0.0;
        let alpha = by_pair
            .iter()
            .filter_map(|p| {
                p.1.iter()
                    .filter(|v| usable(v))
                    .map(|v| v.1)
                    .min_by(f64::total_cmp)
            })
            .fold(0.0, f64::max);
        let beta = by_pair
            .iter()
            .filter_map(|p| {
                p.1.iter()
                    .filter(|v| usable(v))
                    .map(|v| v.2)
                    .max_by(f64::total_cmp)
            })
            .fold(f64::INFINITY, f64::min);
        let advertised = (self.cost.alpha_us, self.cost.beta_gbs);
        let usable = alpha > 0.0 && beta.is_finite();
        let name = |lane: u8| {
            links
                .iter()
                .find(|l| l.lane == usize::from(lane))
                .map_or("?", |l| l.net)
        };
        let choices = by_pair
            .iter()
            .filter(|p| p.1.len() > 1)
            .map(|(hosts, lanes)| {
                let steps = choose_by_size(lanes);
                (*hosts, steps.iter().map(|&(f, l)| (f, name(l))).collect())
            })
            .collect();
        self.choose_lanes(&by_pair);
        let measured = MeasuredLinks {
            links,
            // Nothing usable measured (no pair answered with figures): the model keeps the
            // advertised figures, and says so.
            model: if usable {
                (alpha, beta * self.cost.cpu_share)
            } else {
                advertised
            },
            advertised,
            choices,
        };
        if usable {
            self.cost.alpha_us = measured.model.0;
            self.cost.beta_gbs = measured.model.1;
            if let Some((_, outer)) = &mut self.hier_cost {
                outer.alpha_us = measured.model.0;
                outer.beta_gbs = beta * outer.cpu_share;
            }
            // The table's all-reduce chose under the advertised figures: not a choice to
            // reuse for the next call of its size.
            self.last_choice = None;
            // From the host's spin each time: a later table (a new measurement, or one a
            // test or tool sets) replaces the stretch of an earlier one.
            let spin = self.cfg.waiter.spin;
            self.cfg.waiter.spin = self.host_spin;
            self.cfg
                .waiter
                .fit_latency(Duration::from_secs_f64(alpha.max(0.0) * 1e-6));
            if self.cfg.waiter.spin != spin {
                crate::info!(
                    "waits spin {:?} (was {spin:?}): {} one-way latencies of the slowest link between hosts ({alpha:.1} µs)",
                    self.cfg.waiter.spin,
                    crate::os::wait::SPIN_LATENCIES
                );
            }
        }
        if let Some(m) = &self.links.watch.metrics {
            m.set_measured_links(
                measured
                    .links
                    .iter()
                    .map(|l| (l.hosts, l.ranks, l.net, l.alpha_us, l.beta_gbs)),
                measured.choices.clone(),
            );
        }
        self.measured = Some(measured.clone());
        measured
    }

    /// Each peer's lane by call size ([`Lanes::by_size`]), from its pair of hosts' measured
    /// lanes that both ranks have: the same steps at both ends.
    ///
    /// [`Lanes::by_size`]: crate::exec::links::Lanes::by_size
    fn choose_lanes(&mut self, by_pair: &[PairLanes]) {
        let Some(topo) = self.topo.clone() else {
            return;
        };
        let me = topo.host_of(self.links.rank);
        let lanes = &mut self.links.lanes;
        for p in 0..lanes.endpoints.len() {
            let h = topo.host_of(p);
            let hosts = (me.min(h), me.max(h));
            let have = lanes.endpoints[p];
            let measured: Vec<(u8, f64, f64)> = by_pair
                .iter()
                .find(|x| x.0 == hosts && h != me)
                .map(|x| {
                    x.1.iter()
                        .copied()
                        .filter(|l| have[usize::from(l.0)].is_some())
                        .collect()
                })
                .unwrap_or_default();
            let steps = choose_by_size(&measured);
            lanes.by_size[p] = if steps.iter().all(|s| s.1 == 0) {
                Vec::new()
            } else {
                steps
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_is_measured_once_and_no_host_twice_in_a_round() {
        for hosts in [2, 3, 4, 5, 8, 16, 17, 40] {
            let all = pairs(hosts);
            let rs = rounds(&all);
            let mut seen: Vec<(usize, usize)> = rs.iter().flatten().copied().collect();
            seen.sort();
            let mut want = all.clone();
            want.sort();
            assert_eq!(seen, want, "{hosts} hosts");
            for r in &rs {
                let mut hs: Vec<usize> = r.iter().flat_map(|&(a, b)| [a, b]).collect();
                hs.sort();
                hs.dedup();
                assert_eq!(
                    hs.len(),
                    2 * r.len(),
                    "{hosts} hosts: a host twice in {r:?}"
                );
            }
            if hosts <= ALL_PAIRS_UP_TO {
                assert_eq!(all.len(), hosts * (hosts - 1) / 2);
            } else {
                assert_eq!(all.len(), hosts);
            }
        }
    }

    /// The lane of least α + s/β wins at each size; where one lane is better at every size
    /// it is the only step; ties go to the main network; lanes without figures are left out.
    #[test]
    fn each_size_takes_the_network_of_least_time() {
        // tcp: 5 µs, 0.1 GB/s (100 B/µs); rocev2: 50 µs, 10 GB/s: equal at 45/(1/100 -
        // 1/10000) = 4545.45 bytes.
        let steps = choose_by_size(&[(0, 5.0, 0.1), (2, 50.0, 10.0)]);
        assert_eq!(steps, vec![(0, 0), (4546, 2)]);
        for s in [0usize, 100, 4545, 4546, 1 << 20] {
            let chosen = steps.iter().take_while(|x| x.0 <= s).last().unwrap().1;
            let t = |a: f64, b: f64| a + s as f64 / (b * 1e3);
            let want = if t(5.0, 0.1) <= t(50.0, 10.0) { 0 } else { 2 };
            assert_eq!(chosen, want, "{s} bytes");
        }
        // Better at every size: one step.
        assert_eq!(
            choose_by_size(&[(0, 50.0, 1.0), (1, 5.0, 2.0)]),
            vec![(0, 1)]
        );
        // Equal lanes: the main one.
        assert_eq!(
            choose_by_size(&[(0, 5.0, 1.0), (1, 5.0, 1.0)]),
            vec![(0, 0)]
        );
        // Three lanes: the lowest latency, then the middle, then the widest.
        let steps = choose_by_size(&[(0, 1.0, 0.1), (1, 10.0, 1.0), (2, 100.0, 10.0)]);
        assert_eq!(steps.iter().map(|s| s.1).collect::<Vec<_>>(), [0, 1, 2]);
        // A lane without figures (not measured) is never chosen; none at all: no steps.
        assert_eq!(
            choose_by_size(&[(0, 5.0, 1.0), (1, 0.0, 0.0)]),
            vec![(0, 0)]
        );
        assert!(choose_by_size(&[]).is_empty());
        assert_eq!(
            describe_steps(&[(0, "tcp"), (49152, "rocev2")]),
            "tcp below 48 KiB, rocev2 from 48 KiB"
        );
        assert_eq!(describe_steps(&[(0, "tcp")]), "tcp at every size");
    }

    #[test]
    fn latency_is_half_the_fastest_round_trip_and_bandwidth_leaves_one_out() {
        let us = Duration::from_micros;
        // Round trips as a loaded host gives them: most waited for a core.
        let (a, b) = figures(
            &[us(80), us(30), us(12), us(500), us(78), us(81)],
            us(1012),
            1_000_000,
        );
        assert!((a - 6.0).abs() < 1e-9, "{a}");
        assert!((b - 1.0).abs() < 1e-6, "{b}");
        // A burst no longer than a round trip: at least half of it is counted as moving.
        let (_, b) = figures(&[us(100)], us(100), 1_000_000);
        assert!((b - 20.0).abs() < 1e-6, "{b}");
    }
}
