//! Groups: an algorithm run on some of the ranks, or on all of them in another order
//! (hierarchical collectives, rings ordered by host). The executor translates the group's
//! rank numbers to global ranks where requests and connections are made.

use super::Exec;
use crate::error::{Error, Result};

/// (peer, channel) pairs of a group's numbers as global ranks (`members`).
pub(super) fn to_global(
    it: impl IntoIterator<Item = (usize, usize)>,
    members: &[usize],
) -> Result<Vec<(usize, usize)>> {
    it.into_iter()
        .map(|(p, c)| {
            members.get(p).map(|&g| (g, c)).ok_or_else(|| {
                Error::Internal(format!(
                    "peer {p} is out of range for a group of {}",
                    members.len()
                ))
            })
        })
        .collect()
}

impl Exec<'_> {
    /// Run what follows on a group of ranks: `members[i]` is the global rank the algorithm
    /// calls `i` (a subset, such as the ranks of one host, or every rank in another order,
    /// such as a ring that crosses each host boundary once). [`rank`](Self::rank),
    /// [`nranks`](Self::nranks), sends, receives and connections then speak the group's
    /// numbers. An empty list returns to every rank in rank order. This rank must be a member.
    pub fn set_group(&mut self, members: &[usize]) -> Result<()> {
        let me = self.links.rank;
        let Some(pos) = members.iter().position(|&m| m == me) else {
            if members.is_empty() {
                self.members.clear();
                return Ok(());
            }
            return Err(Error::Internal(format!(
                "rank {me} runs an algorithm on a group it is not in ({members:?})"
            )));
        };
        if let Some(&bad) = members.iter().find(|&&m| m >= self.links.nranks) {
            return Err(Error::Internal(format!(
                "group member {bad} is out of range for {} ranks",
                self.links.nranks
            )));
        }
        self.members.clear();
        self.members.extend_from_slice(members);
        self.me = pos;
        Ok(())
    }

    /// The global rank of the group's rank `v` (where a collective's layout follows global
    /// ranks: the blocks of an all-gather or reduce-scatter).
    pub fn member(&self, v: usize) -> usize {
        if self.members.is_empty() {
            v
        } else {
            self.members[v]
        }
    }

    /// The group's rank of global rank `g`, if it is a member.
    pub fn group_rank(&self, g: usize) -> Option<usize> {
        if self.members.is_empty() {
            (g < self.links.nranks).then_some(g)
        } else {
            self.members.iter().position(|&m| m == g)
        }
    }

    /// The global rank of the group's peer `v`, checked.
    pub(super) fn global(&self, v: usize) -> Result<usize> {
        if self.members.is_empty() {
            return Ok(v);
        }
        self.members.get(v).copied().ok_or_else(|| {
            Error::Internal(format!(
                "peer {v} is out of range for a group of {}",
                self.members.len()
            ))
        })
    }
}
