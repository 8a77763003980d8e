//! The links between hosts, measured at init (`ROCCL_MEASURE`, [`Config::measure_links`]).
//!
//! A NIC's advertised speed says little about a `thunderbolt-net` link, a shaped port or a
//! loaded host, so on a job of several hosts one rank of each host (its first) measures the
//! link to the first rank of every other host through the communicator itself, as calls
//! will use it: one exchange that meets the peer (and opens the connection), then
//! [`PINGS`] round trips of 8 bytes (latency: half the median round trip), bursts from
//! [`BURST_FIRST`] bytes doubling until one lasts [`BURST_TIME`] (at most [`BURST_MAX`]), then
//! [`BURSTS`] bursts of that size, each answered by 8 bytes (bandwidth: the bytes over the
//! fastest burst's time less one round trip). Pairs run in rounds where no host is in two pairs, so a
//! measurement never shares its rank with another. Every rank then takes the same table,
//! merged by an all-reduce (each cell is written by one rank, the others hold zero), and
//! the cost model takes the slowest pair's latency and bandwidth for the links between
//! hosts: every rank decides from the same numbers.
//!
//! [`Config::measure_links`]: super::Config::measure_links

use std::time::{Duration, Instant};

use super::{Communicator, State};
use crate::error::Result;
use crate::types::RedOp;

/// Timed round trips of 8 bytes per pair.
pub const PINGS: usize = 8;
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

/// One measured link between two hosts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredLink {
    /// The hosts (in the order the job's topology numbers them), the lower first.
    pub hosts: (usize, usize),
    /// The ranks that measured it (each its host's first rank).
    pub ranks: (usize, usize),
    /// Half the median round trip of an 8-byte message, in µs.
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
                "\n  hosts {}↔{} (ranks {}↔{}): α={:.1}µs β={:.3}GB/s",
                l.hosts.0, l.hosts.1, l.ranks.0, l.ranks.1, l.alpha_us, l.beta_gbs
            ));
        }
        s
    }
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
fn figures(mut rtts: Vec<Duration>, burst: Duration, bytes: usize) -> (f64, f64) {
    rtts.sort();
    let rtt = rtts.get(rtts.len() / 2).copied().unwrap_or_default();
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

    /// Measure the links between hosts (see the module), share the table and hand it to the
    /// cost model. Every rank of a job of several hosts calls it once, at init.
    pub(super) fn measure_links(&self) -> Result<()> {
        let topo = match self.with_turn(|state| state.topo.clone()) {
            Some(t) if t.nhosts() > 1 => t,
            _ => return Ok(()),
        };
        let (rank, hosts) = (self.rank(), topo.nhosts());
        let first = |h: usize| topo.at(h, 0).expect("every host has a rank");
        let all = pairs(hosts);
        // Two cells per measured pair, in `all`'s order.
        let mut table = vec![0f64; 2 * all.len()];
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
                if a == my_host {
                    let (alpha, beta) = self.probe(first(b)).inspect_err(said)?;
                    let at = all
                        .iter()
                        .position(|&p| p == (a, b))
                        .expect("a listed pair");
                    table[2 * at] = alpha;
                    table[2 * at + 1] = beta;
                } else {
                    self.answer(first(a)).inspect_err(said)?;
                }
            }
        }
        self.all_reduce_in_place(&mut table, RedOp::Max)
            .inspect_err(said)?;
        let links: Vec<MeasuredLink> = all
            .iter()
            .zip(table.chunks_exact(2))
            .map(|(&(a, b), cell)| MeasuredLink {
                hosts: (a, b),
                ranks: (first(a), first(b)),
                alpha_us: cell[0],
                beta_gbs: cell[1],
            })
            .collect();
        let measured = self.with_turn(|state| state.take_measured(links));
        if rank == 0 {
            crate::info!(
                "rank 0: links measured at init (ROCCL_MEASURE): {}",
                measured.describe()
            );
        }
        Ok(())
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
        Ok(figures(rtts, fastest, size))
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
    /// Keep the measured `links` and give the cost model of the links between hosts (the
    /// flat calls' and the hierarchical calls' outer one) the slowest pair's figures, each
    /// rank's share of the bandwidth scaled as the advertised figure was.
    fn take_measured(&mut self, links: Vec<MeasuredLink>) -> MeasuredLinks {
        let alpha = links.iter().map(|l| l.alpha_us).fold(0.0, f64::max);
        let beta = links
            .iter()
            .map(|l| l.beta_gbs)
            .filter(|&b| b > 0.0)
            .fold(f64::INFINITY, f64::min);
        let advertised = (self.cost.alpha_us, self.cost.beta_gbs);
        let usable = alpha > 0.0 && beta.is_finite();
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
        }
        if let Some(m) = &self.links.watch.metrics {
            m.set_measured_links(
                measured
                    .links
                    .iter()
                    .map(|l| (l.hosts, l.ranks, l.alpha_us, l.beta_gbs)),
            );
        }
        self.measured = Some(measured.clone());
        measured
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

    #[test]
    fn latency_is_half_the_median_round_trip_and_bandwidth_leaves_one_out() {
        let us = Duration::from_micros;
        let (a, b) = figures(
            vec![us(30), us(10), us(12), us(500), us(11)],
            us(1012),
            1_000_000,
        );
        assert!((a - 6.0).abs() < 1e-9, "{a}");
        assert!((b - 1.0).abs() < 1e-6, "{b}");
        // A burst no longer than a round trip: at least half of it is counted as moving.
        let (_, b) = figures(vec![us(100)], us(100), 1_000_000);
        assert!((b - 20.0).abs() < 1e-6, "{b}");
    }
}
