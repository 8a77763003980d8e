//! Where ranks are: hosts from the rendezvous, the ring order that crosses each host boundary
//! once, and the groups of hierarchical collectives (the ranks of one host; the ranks of the
//! same local index on every host; one leader per host).
//!
//! Every rank builds the same [`Topology`] from the same table of host ids, so every rank
//! agrees on orders and groups without a message.

/// Hosts and ranks of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Each rank's host, numbered by the host's lowest rank (host 0 holds rank 0).
    host: Vec<usize>,
    /// The ranks of each host, in rank order.
    hosts: Vec<Vec<usize>>,
    /// Every rank, host after host, each host's ranks in rank order.
    ring: Vec<usize>,
    /// The fewest NICs the ranks of any host spread over (at least 1).
    nics: usize,
}

impl Topology {
    /// The topology of ranks whose host ids are `ids` (rank order).
    pub fn new(ids: &[u64]) -> Topology {
        let mut seen: Vec<u64> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        let host = ids
            .iter()
            .enumerate()
            .map(|(r, id)| match seen.iter().position(|s| s == id) {
                Some(h) => {
                    hosts[h].push(r);
                    h
                }
                None => {
                    seen.push(*id);
                    hosts.push(vec![r]);
                    hosts.len() - 1
                }
            })
            .collect();
        let ring = hosts.iter().flatten().copied().collect();
        Topology {
            host,
            hosts,
            ring,
            nics: 1,
        }
    }

    /// This topology, its hosts' ranks spread over `nics` NICs each (the fewest of any host).
    pub fn with_nics(self, nics: usize) -> Topology {
        Topology {
            nics: nics.max(1),
            ..self
        }
    }

    /// The fewest NICs the ranks of any host spread over (at least 1).
    pub fn nics(&self) -> usize {
        self.nics
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.host.len()
    }

    /// Hosts in the job.
    pub fn nhosts(&self) -> usize {
        self.hosts.len()
    }

    /// The most ranks on one host.
    pub fn max_local(&self) -> usize {
        self.hosts.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Every host holds the same number of ranks.
    pub fn even(&self) -> bool {
        self.hosts.iter().all(|h| h.len() == self.hosts[0].len())
    }

    /// A hierarchy exists: several hosts, and several ranks on at least one.
    pub fn layered(&self) -> bool {
        self.nhosts() > 1 && self.max_local() > 1
    }

    /// The host of rank `r`.
    pub fn host_of(&self, r: usize) -> usize {
        self.host[r]
    }

    /// The ranks of rank `r`'s host, in rank order.
    pub fn local(&self, r: usize) -> &[usize] {
        &self.hosts[self.host[r]]
    }

    /// Rank `r`'s place among the ranks of its host.
    pub fn local_index(&self, r: usize) -> usize {
        self.local(r).iter().position(|&x| x == r).unwrap_or(0)
    }

    /// The rank of local index `i` on host `h`, if that host has so many.
    pub fn at(&self, h: usize, i: usize) -> Option<usize> {
        self.hosts.get(h).and_then(|ranks| ranks.get(i)).copied()
    }

    /// The ranks with rank `r`'s local index, one per host that has that many ranks, in host
    /// order (with even hosts: one per host).
    pub fn cross(&self, r: usize) -> Vec<usize> {
        let i = self.local_index(r);
        self.hosts
            .iter()
            .filter_map(|h| h.get(i).copied())
            .collect()
    }

    /// One rank per host, in host order: `root` for its own host, the lowest rank for the
    /// others.
    pub fn leaders(&self, root: usize) -> Vec<usize> {
        let rh = self.host[root];
        self.hosts
            .iter()
            .enumerate()
            .map(|(h, ranks)| if h == rh { root } else { ranks[0] })
            .collect()
    }

    /// Every rank in the order a ring takes: host after host, so that a ring crosses each
    /// host boundary once (what NCCL's rings do).
    pub fn ring(&self) -> &[usize] {
        &self.ring
    }

    /// The ring order is rank order (each host's ranks are consecutive already).
    pub fn ring_in_rank_order(&self) -> bool {
        self.ring.iter().enumerate().all(|(i, &r)| i == r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_groups_and_ring_order() {
        // Ranks dealt round-robin over 2 hosts (Slurm's cyclic distribution).
        let t = Topology::new(&[7, 9, 7, 9, 7, 9]);
        assert_eq!(
            (t.nhosts(), t.max_local(), t.even(), t.layered()),
            (2, 3, true, true)
        );
        assert_eq!(t.ring(), &[0, 2, 4, 1, 3, 5]);
        assert!(!t.ring_in_rank_order());
        assert_eq!(t.local(3), &[1, 3, 5]);
        assert_eq!(t.local_index(3), 1);
        assert_eq!(t.cross(3), vec![2, 3]);
        assert_eq!(t.leaders(5), vec![0, 5]);
        assert_eq!(t.leaders(2), vec![2, 1]);
        // Uneven: 3 ranks on one host, 1 on another.
        let u = Topology::new(&[1, 1, 1, 2]);
        assert!(!u.even() && u.layered() && u.ring_in_rank_order());
        assert_eq!(u.cross(1), vec![1]);
        assert_eq!(u.cross(0), vec![0, 3]);
        assert_eq!(u.leaders(3), vec![0, 3]);
        // One host, or one rank per host: no hierarchy.
        assert!(!Topology::new(&[4, 4, 4]).layered());
        assert!(!Topology::new(&[1, 2, 3]).layered());
    }
}
