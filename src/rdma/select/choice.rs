//! Choosing a port and GID ([`choose`]), the errors that say why none fit, and the table
//! of every port's GIDs ([`describe`]).

use crate::error::{Error, Result};

use super::criteria::{Criteria, Family, HcaFilter};
use super::sysfs::{natural_cmp, GidEntry, PortInfo};
use super::{FAMILY_VAR, GID_INDEX_VAR, HCA_VAR, RANGE_VAR, SYSFS_ROOT};

/// The device, port and GID [`choose`] picked, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Device name.
    pub dev: String,
    /// Port number.
    pub port: u32,
    /// GID index (same as `gid.index`).
    pub gid_index: u32,
    /// The chosen GID entry.
    pub gid: GidEntry,
    /// One sentence on why this entry, and why earlier ones were passed over.
    pub why: String,
}

/// Why a port gave no GID.
enum Reject {
    /// Not allowed by `ROCCL_IB_HCA`.
    Filtered,
    /// Link layer is not Ethernet.
    NotEthernet,
    /// Port is not ACTIVE.
    NotActive,
    /// No suitable GID entry; the text says why (after "mlx5_0 port 1 ").
    NoGid(String),
}

/// The text after "mlx5_0 port 1 " explaining a rejection.
fn reject_text(p: &PortInfo, r: &Reject, c: &Criteria) -> String {
    match r {
        Reject::Filtered => {
            let hca = c.hca.as_ref().map_or("", |h| h.spec());
            let verb = if c.hca.as_ref().is_some_and(|h| h.is_exclude()) {
                "is excluded by"
            } else {
                "is not selected by"
            };
            format!("{verb} {HCA_VAR}={hca}")
        }
        Reject::NotEthernet => format!("is {}, not Ethernet", p.link_layer),
        Reject::NotActive if p.state.eq_ignore_ascii_case("DOWN") => "is DOWN".to_string(),
        Reject::NotActive => format!("is {}, not ACTIVE", p.state),
        Reject::NoGid(s) => s.clone(),
    }
}

/// Why an entry does not suit an automatic choice, or `None` if it does.
fn unsuitable(g: &GidEntry, c: &Criteria) -> Option<String> {
    let mut why = Vec::new();
    if !g.roce_v2 {
        why.push("RoCE v1".to_string());
    }
    let ip = g.ip();
    if g.is_zero() {
        why.push("empty".to_string());
    } else if g.is_link_local() {
        why.push("link-local".to_string());
    } else if Family::of(&ip) != c.family {
        why.push(Family::of(&ip).to_string());
    } else if let Some(r) = c.range.filter(|r| !r.contains(ip)) {
        why.push(format!("outside {r}"));
    }
    (!why.is_empty()).then(|| why.join(" "))
}

/// "0-3, 5, 7-8".
pub(super) fn index_ranges(idx: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            idx[i].to_string()
        } else {
            format!("{}-{}", idx[i], idx[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// "GIDs 0-1 are link-local, 2 is RoCE v1" from (index, reason) pairs sorted by index.
fn skipped_text(skipped: &[(u32, String)]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < skipped.len() {
        let mut j = i;
        while j + 1 < skipped.len()
            && skipped[j + 1].0 == skipped[j].0 + 1
            && skipped[j + 1].1 == skipped[i].1
        {
            j += 1;
        }
        let first = parts.is_empty();
        let reason = &skipped[i].1;
        parts.push(match (i == j, first) {
            (true, true) => format!("GID {} is {reason}", skipped[i].0),
            (true, false) => format!("{} is {reason}", skipped[i].0),
            (false, true) => format!("GIDs {}-{} are {reason}", skipped[i].0, skipped[j].0),
            (false, false) => format!("{}-{} are {reason}", skipped[i].0, skipped[j].0),
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// The port's entries and unreadable indices, by index (`None`: unreadable).
fn slots(p: &PortInfo) -> Vec<(u32, Option<&GidEntry>)> {
    let mut v: Vec<(u32, Option<&GidEntry>)> = p.gids.iter().map(|g| (g.index, Some(g))).collect();
    v.extend(p.unreadable.iter().map(|&i| (i, None)));
    v.sort_by_key(|s| s.0);
    v
}

/// A row of a GID listing: an entry, or a run of consecutive unreadable indices.
enum Row<'a> {
    /// A readable entry.
    Entry(&'a GidEntry),
    /// Unreadable indices `first..=last`.
    Unreadable(u32, u32),
}

/// The port's entries by index, runs of unreadable indices merged (a kernel may refuse
/// hundreds of them).
fn rows(p: &PortInfo) -> Vec<Row<'_>> {
    let mut out: Vec<Row<'_>> = Vec::new();
    for (i, s) in slots(p) {
        match (s, out.last_mut()) {
            (Some(g), _) => out.push(Row::Entry(g)),
            (None, Some(Row::Unreadable(_, last))) if *last + 1 == i => *last = i,
            (None, _) => out.push(Row::Unreadable(i, i)),
        }
    }
    out
}

/// "3" or "3-7".
fn span(first: u32, last: u32) -> String {
    if first == last {
        first.to_string()
    } else {
        format!("{first}-{last}")
    }
}

/// "0 fe80::1 RoCE v2 link-local" for error messages.
fn entry_text(g: &GidEntry) -> String {
    let ll = if g.is_link_local() { " link-local" } else { "" };
    format!("{} {} {}{ll}", g.index, g.ip(), g.kind())
}

/// GID entries passed over, as (index, reason) pairs by increasing index.
type Skipped = Vec<(u32, String)>;

/// The first suitable entry of `p` for an automatic choice, with the entries skipped before
/// it; or the rejection.
fn pick_auto<'a>(
    p: &'a PortInfo,
    c: &Criteria,
) -> std::result::Result<(&'a GidEntry, Skipped), Reject> {
    let mut skipped = Vec::new();
    for (index, slot) in slots(p) {
        match slot {
            None => skipped.push((index, "unreadable".to_string())),
            Some(g) => match unsuitable(g, c) {
                None => return Ok((g, skipped)),
                Some(why) => skipped.push((index, why)),
            },
        }
    }
    let range = c.range.map(|r| format!(" in {r}")).unwrap_or_default();
    let entries: Vec<String> = rows(p)
        .into_iter()
        .map(|r| match r {
            Row::Entry(g) => entry_text(g),
            Row::Unreadable(a, b) => format!("{} unreadable", span(a, b)),
        })
        .collect();
    let entries = if entries.is_empty() {
        "no GID entries".to_string()
    } else {
        format!("entries: {}", entries.join(", "))
    };
    Err(Reject::NoGid(format!(
        "has no RoCE v2 {} GID{range} ({entries})",
        c.family
    )))
}

/// The entry at the forced `index` of `p`, or the rejection.
fn pick_forced(p: &PortInfo, index: u32) -> std::result::Result<&GidEntry, Reject> {
    if let Some(g) = p.gid(index).filter(|g| !g.is_zero()) {
        return Ok(g);
    }
    if p.unreadable.contains(&index) {
        return Err(Reject::NoGid(format!(
            "cannot read GID {index} (sysfs refused it, as happens in containers)"
        )));
    }
    let mut have: Vec<u32> = p
        .gids
        .iter()
        .filter(|g| !g.is_zero())
        .map(|g| g.index)
        .collect();
    have.sort_unstable();
    let mut bad = p.unreadable.clone();
    bad.sort_unstable();
    let mut known = Vec::new();
    if !have.is_empty() {
        known.push(format!("readable indices: {}", index_ranges(&have)));
    }
    if !bad.is_empty() {
        known.push(format!("unreadable: {}", index_ranges(&bad)));
    }
    let known = if known.is_empty() {
        "its table is empty".to_string()
    } else {
        known.join("; ")
    };
    Err(Reject::NoGid(format!(
        "has no GID at index {index} ({known})"
    )))
}

/// Pick the device, port and GID to use.
///
/// Only ACTIVE ports with an Ethernet link layer that the HCA filter allows are considered,
/// in device order (numbers compared numerically), then port order.
///
/// - With a forced `gid_index`, the first such port that has a readable entry at that index
///   gives it, whatever its type and address (the family and range are not applied; the
///   explanation warns about RoCE v1 or link-local entries).
/// - Otherwise the lowest-index entry that is RoCE v2, not all zeros, not link-local
///   (`fe80::/10`), of the wanted family (IPv4-mapped GIDs count as IPv4) and inside the range.
///
/// [`Choice::why`] explains in one sentence, e.g. `mlx5_0 port 1 GID 3: RoCE v2, IPv4
/// 192.168.1.2 on ens1f0np0 (GID 0 is RoCE v1 link-local, 1 is link-local, 2 is RoCE v1)`.
///
/// When nothing fits, the [`Error::InvalidArgument`] says why for every port (excluded by
/// the filter, not Ethernet, not ACTIVE, the GID entries it has) and how to fix it. A range
/// of the other family than `c.family` is an error too.
pub fn choose(ports: &[PortInfo], c: &Criteria) -> Result<Choice> {
    if let Some(r) = c.range.filter(|r| r.family() != c.family) {
        return Err(Error::arg(format!(
            "{RANGE_VAR}={r} is an {} range but the wanted family is {}",
            r.family(),
            c.family
        )));
    }
    let mut order: Vec<&PortInfo> = ports.iter().collect();
    order.sort_by(|a, b| natural_cmp(&a.dev, &b.dev).then(a.port.cmp(&b.port)));
    let mut rejected: Vec<(&PortInfo, Reject)> = Vec::new();
    for p in order {
        let reject = if !c.hca.as_ref().map_or(true, |h| h.allows(&p.dev, p.port)) {
            Some(Reject::Filtered)
        } else if !p.ethernet {
            Some(Reject::NotEthernet)
        } else if !p.active {
            Some(Reject::NotActive)
        } else {
            None
        };
        if let Some(r) = reject {
            rejected.push((p, r));
            continue;
        }
        let (g, detail) = match c.gid_index {
            Some(index) => match pick_forced(p, index) {
                Ok(g) => {
                    let mut warn = Vec::new();
                    if !g.roce_v2 {
                        warn.push("not RoCE v2");
                    }
                    if g.is_link_local() {
                        warn.push("link-local, reachable only on the same L2 segment");
                    }
                    let warn = if warn.is_empty() {
                        String::new()
                    } else {
                        format!(" (warning: {})", warn.join("; "))
                    };
                    (
                        g,
                        format!("forced by {GID_INDEX_VAR}, {}", kind_family(g)) + &warn,
                    )
                }
                Err(r) => {
                    rejected.push((p, r));
                    continue;
                }
            },
            None => match pick_auto(p, c) {
                Ok((g, skipped)) => {
                    let skipped = if skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", skipped_text(&skipped))
                    };
                    (g, kind_family(g) + &skipped)
                }
                Err(r) => {
                    rejected.push((p, r));
                    continue;
                }
            },
        };
        let earlier = if rejected.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = rejected
                .iter()
                .map(|(q, r)| format!("{} {}", q.name(), reject_text(q, r, c)))
                .collect();
            format!("; passed over: {}", list.join("; "))
        };
        return Ok(Choice {
            dev: p.dev.clone(),
            port: p.port,
            gid_index: g.index,
            gid: g.clone(),
            why: format!("{} GID {}: {detail}{earlier}", p.name(), g.index),
        });
    }
    Err(no_choice(ports, &rejected, c))
}

/// Every port to use: where `ROCCL_IB_HCA` lists several devices or ports (not `^`), each
/// listed port that [`choose`] would take on its own, in device order; otherwise the one
/// [`choose`] picks. An error only when none qualifies ([`choose`]'s, naming why each was
/// passed over).
pub fn choose_each(ports: &[PortInfo], c: &Criteria) -> Result<Vec<Choice>> {
    if !c.hca.as_ref().is_some_and(HcaFilter::lists_several) {
        return choose(ports, c).map(|one| vec![one]);
    }
    let mut order: Vec<&PortInfo> = ports.iter().collect();
    order.sort_by(|a, b| natural_cmp(&a.dev, &b.dev).then(a.port.cmp(&b.port)));
    let each: Vec<Choice> = order
        .into_iter()
        .filter_map(|p| choose(std::slice::from_ref(p), c).ok())
        .collect();
    if each.is_empty() {
        return choose(ports, c).map(|one| vec![one]);
    }
    Ok(each)
}

/// "RoCE v2, IPv4 192.168.1.2 on eth0".
fn kind_family(g: &GidEntry) -> String {
    format!("{}, {} {}", g.kind(), Family::of(&g.ip()), g.addr_on())
}

/// The error [`choose`] returns when no port gives a GID.
fn no_choice(ports: &[PortInfo], rejected: &[(&PortInfo, Reject)], c: &Criteria) -> Error {
    let head = match c.gid_index {
        Some(i) => format!("no usable GID at {GID_INDEX_VAR}={i}"),
        None => "no usable RoCE v2 GID".to_string(),
    };
    if ports.is_empty() {
        return Error::arg(format!(
            "{head}: no RDMA device found in {SYSFS_ROOT}. Fix: load the NIC's RDMA driver \
             (irdma for Intel E810, mlx5_ib for NVIDIA ConnectX) and check `rdma link`; in a \
             container, expose {SYSFS_ROOT} and /dev/infiniband."
        ));
    }
    let reasons: Vec<String> = rejected
        .iter()
        .map(|(p, r)| format!("{} {}", p.name(), reject_text(p, r, c)))
        .collect();
    let mut fixes: Vec<String> = Vec::new();
    let mut add = |s: String| {
        if !fixes.contains(&s) {
            fixes.push(s);
        }
    };
    for (_, r) in rejected {
        match r {
            Reject::Filtered => {
                let seen: Vec<String> = ports
                    .iter()
                    .map(|p| format!("{}:{}", p.dev, p.port))
                    .collect();
                add(format!(
                    "change or unset {HCA_VAR} (ports found: {})",
                    seen.join(", ")
                ));
            }
            Reject::NotEthernet => add(
                "use a RoCE port (Ethernet link layer): roccl does not drive InfiniBand links"
                    .to_string(),
            ),
            Reject::NotActive => {
                add("bring the port up (cable, switch port, `ip link set <netdev> up`)".into())
            }
            Reject::NoGid(_) if c.gid_index.is_some() => add(format!(
                "set {GID_INDEX_VAR} to a readable index, or unset it"
            )),
            Reject::NoGid(_) => {
                let widen = if c.range.is_some() {
                    format!("widen or unset {RANGE_VAR}, ")
                } else {
                    String::new()
                };
                add(format!(
                    "{widen}assign {} address to its netdev, or set {GID_INDEX_VAR} / \
                     {FAMILY_VAR}={}",
                    match c.family {
                        Family::V4 => "an IPv4",
                        Family::V6 => "a global IPv6",
                    },
                    c.family.other_var_value()
                ));
            }
        }
    }
    Error::arg(format!(
        "{head}: {}. Fix: {}.",
        reasons.join("; "),
        fixes.join("; ")
    ))
}

/// A table of every port and its GID entries, the chosen entry marked with `=>` and
/// `<- chosen`, followed by the choice's explanation; for `roccl-info` and debug logs.
pub fn describe(ports: &[PortInfo], choice: Option<&Choice>) -> String {
    if ports.is_empty() {
        return format!("no RDMA device found in {SYSFS_ROOT}\n");
    }
    let mut out = String::new();
    for p in ports {
        let mut facts = vec![p.state.clone(), p.link_layer.clone()];
        if let Some(r) = p.rate_gbps {
            facts.push(format!("{r} Gb/s"));
        }
        if let Some(pci) = &p.pci {
            facts.push(format!("pci {pci}"));
        }
        if let Some(n) = p.netdev() {
            match p.netdev_mtu {
                Some(m) => facts.push(format!("netdev {n} mtu {m}")),
                None => facts.push(format!("netdev {n}")),
            }
        }
        if let Some(g) = &p.node_guid {
            facts.push(format!("guid {g}"));
        }
        out.push_str(&format!("{}: {}\n", p.name(), facts.join(", ")));
        let listing = rows(p);
        let cells: Vec<[String; 4]> = listing
            .iter()
            .map(|r| match r {
                Row::Entry(g) => [
                    g.index.to_string(),
                    if p.ethernet { g.kind() } else { "IB" }.to_string(),
                    g.ip().to_string(),
                    g.ndev.clone().unwrap_or_else(|| "-".to_string()),
                ],
                Row::Unreadable(a, b) => [
                    span(*a, *b),
                    "unreadable".to_string(),
                    "-".into(),
                    "-".into(),
                ],
            })
            .collect();
        if cells.is_empty() {
            out.push_str("      (no GID entries)\n");
            continue;
        }
        let header = [
            "idx".to_string(),
            "type".to_string(),
            "address".to_string(),
            "netdev".to_string(),
        ];
        let mut w = [0usize; 4];
        for r in cells.iter().chain(std::iter::once(&header)) {
            for (k, cell) in r.iter().enumerate() {
                w[k] = w[k].max(cell.len());
            }
        }
        let line = |mark: &str, r: &[String; 4], tail: &str| {
            let text = format!(
                "   {mark:<2} {:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}{tail}",
                r[0],
                r[1],
                r[2],
                r[3],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2],
                w3 = w[3]
            );
            format!("{}\n", text.trim_end())
        };
        out.push_str(&line("", &header, ""));
        for (r, row) in cells.iter().zip(&listing) {
            let chosen = match row {
                Row::Entry(g) => choice.is_some_and(|ch| {
                    ch.dev == p.dev && ch.port == p.port && ch.gid_index == g.index
                }),
                Row::Unreadable(..) => false,
            };
            if chosen {
                out.push_str(&line("=>", r, "  <- chosen"));
            } else {
                out.push_str(&line("", r, ""));
            }
        }
    }
    match choice {
        Some(ch) => out.push_str(&format!("chosen: {}\n", ch.why)),
        None => out.push_str("chosen: none\n"),
    }
    out
}
