//! Tests of the choice against fake sysfs trees and fake environments.

use super::choice::index_ranges;
use super::sysfs::{natural_cmp, parse_rate, parse_state};
use super::*;
use crate::error::{Error, Result};
use std::cmp::Ordering;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;

/// A fake sysfs tree from `tests/data/sysfs/`.
fn tree(case: &str) -> Vec<PortInfo> {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/sysfs")).join(case);
    assert!(root.is_dir(), "missing test tree {}", root.display());
    scan(&root).unwrap()
}

/// Criteria from a fake environment.
fn env(vars: &[(&str, &str)]) -> Result<Criteria> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Criteria::from_lookup(&|name| map.get(name).cloned())
}

fn pick(case: &str, vars: &[(&str, &str)]) -> Result<Choice> {
    choose(&tree(case), &env(vars).unwrap())
}

fn err_text(r: Result<Choice>) -> String {
    match r {
        Ok(c) => panic!("expected an error, chose {c:?}"),
        Err(e) => {
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            e.to_string()
        }
    }
}

#[test]
fn e810_scan() {
    let ports = tree("e810");
    assert_eq!(ports.len(), 1);
    let p = &ports[0];
    assert_eq!((p.dev.as_str(), p.port), ("irdma0", 1));
    assert!(p.active && p.ethernet);
    assert_eq!(p.state, "ACTIVE");
    assert_eq!(p.rate_gbps, Some(100.0));
    // The `device` symlink dangles in the test tree: its own basename is used.
    assert_eq!(p.pci.as_deref(), Some("0000:01:00.0"));
    assert_eq!(p.node_guid.as_deref(), Some("6efe:54ff:fe3d:8a10"));
    assert_eq!(p.netdev(), Some("enp1s0f0"));
    assert_eq!(p.netdev_mtu, None);
    // Index 2 is all zeros: an unused slot, left out and not unreadable.
    let idx: Vec<u32> = p.gids.iter().map(|g| g.index).collect();
    assert_eq!(idx, [0, 1]);
    assert!(p.unreadable.is_empty());
    assert!(p.gids[0].is_link_local() && p.gids[0].roce_v2);
    assert_eq!(p.gids[1].ip(), "10.1.0.11".parse::<IpAddr>().unwrap());
}

#[test]
fn e810_choice() {
    let c = pick("e810", &[]).unwrap();
    assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("irdma0", 1, 1));
    assert_eq!(c.gid.index, 1);
    assert_eq!(
        c.why,
        "irdma0 port 1 GID 1: RoCE v2, IPv4 10.1.0.11 on enp1s0f0 (GID 0 is link-local)"
    );
    // No IPv6 global address on this NIC.
    let e = err_text(pick("e810", &[(FAMILY_VAR, "ipv6")]));
    assert!(e.contains("irdma0 port 1 has no RoCE v2 IPv6 GID (entries: 0 fe80::6efe:54ff:fe3d:8a10 RoCE v2 link-local, 1 10.1.0.11 RoCE v2)"), "{e}");
    assert!(e.contains("ROCCL_IB_ADDR_FAMILY=AF_INET"), "{e}");
}

#[test]
fn mlx5_scan() {
    let ports = tree("mlx5");
    assert_eq!(ports.len(), 1);
    let p = &ports[0];
    // The `device` symlink resolves inside the test tree, which also holds the netdev MTU.
    assert_eq!(p.pci.as_deref(), Some("0000:17:00.0"));
    assert_eq!(p.netdev_mtu, Some(9000));
    let kinds: Vec<(u32, bool)> = p.gids.iter().map(|g| (g.index, g.roce_v2)).collect();
    assert_eq!(
        kinds,
        [
            (0, false),
            (1, true),
            (2, false),
            (3, true),
            (4, false),
            (5, true)
        ]
    );
    assert!(p.unreadable.is_empty());
}

#[test]
fn mlx5_ipv4_and_ipv6() {
    let c = pick("mlx5", &[]).unwrap();
    assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("mlx5_0", 1, 3));
    assert_eq!(c.gid.ip(), "192.168.1.2".parse::<IpAddr>().unwrap());
    assert_eq!(
        c.why,
        "mlx5_0 port 1 GID 3: RoCE v2, IPv4 192.168.1.2 on ens1f0np0 \
         (GID 0 is RoCE v1 link-local, 1 is link-local, 2 is RoCE v1)"
    );
    for v in ["AF_INET6", "ipv6", "af_inet6"] {
        let c = pick("mlx5", &[(FAMILY_VAR, v)]).unwrap();
        assert_eq!(c.gid_index, 5, "{v}");
        assert_eq!(c.gid.ip(), "fd00::2".parse::<IpAddr>().unwrap());
        assert!(c.why.contains("IPv6 fd00::2"), "{}", c.why);
        assert!(
            c.why
                .contains("2 is RoCE v1 IPv4, 3 is IPv4, 4 is RoCE v1)"),
            "{}",
            c.why
        );
    }
    // A range that matches nothing.
    let e = err_text(pick("mlx5", &[(RANGE_VAR, "10.0.0.0/8")]));
    assert!(e.contains("no RoCE v2 IPv4 GID in 10.0.0.0/8"), "{e}");
    assert!(e.contains("widen or unset ROCCL_IB_ADDR_RANGE"), "{e}");
}

#[test]
fn container_unreadable_entries() {
    // gids/2, gid_attrs/types/3 and gid_attrs/ndevs/4 are directories in the test tree:
    // reading them fails with EISDIR, standing in for the EINVAL that containers give.
    let ports = tree("container");
    let p = &ports[0];
    assert_eq!(p.unreadable, [2, 3]);
    let idx: Vec<u32> = p.gids.iter().map(|g| g.index).collect();
    assert_eq!(idx, [0, 1, 4, 5, 6, 7]);
    // An unreadable netdev only loses the name.
    assert_eq!(p.gid(4).unwrap().ndev, None);
    assert_eq!(p.gid(5).unwrap().ndev.as_deref(), Some("eth0"));
    let c = choose(&ports, &Criteria::default()).unwrap();
    assert_eq!(c.gid_index, 7);
    assert_eq!(c.gid.ip(), "192.168.1.3".parse::<IpAddr>().unwrap());
    assert!(c.why.contains("2-3 are unreadable"), "{}", c.why);
    assert!(c.why.contains("4 is RoCE v1 IPv6, 5 is IPv6"), "{}", c.why);
    let table = describe(&ports, Some(&c));
    assert!(table.contains("unreadable"), "{table}");
}

#[test]
fn two_nics() {
    let c = pick("two_nics", &[]).unwrap();
    assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_0", 3));
    assert_eq!(c.gid.ip(), "10.0.0.5".parse::<IpAddr>().unwrap());

    let c = pick("two_nics", &[(RANGE_VAR, "10.1.0.0/16")]).unwrap();
    assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_1", 3));
    assert!(
        c.why
            .contains("passed over: mlx5_0 port 1 has no RoCE v2 IPv4 GID in 10.1.0.0/16"),
        "{}",
        c.why
    );

    let c = pick("two_nics", &[(HCA_VAR, "^mlx5_0")]).unwrap();
    assert_eq!((c.dev.as_str(), c.port), ("mlx5_1", 1));
    assert!(
        c.why
            .contains("passed over: mlx5_0 port 1 is excluded by ROCCL_IB_HCA=^mlx5_0"),
        "{}",
        c.why
    );

    let c = pick("two_nics", &[(HCA_VAR, "=mlx5_1:1")]).unwrap();
    assert_eq!((c.dev.as_str(), c.port, c.gid_index), ("mlx5_1", 1, 3));

    let e = err_text(pick("two_nics", &[(HCA_VAR, "mlx5_1:2")]));
    assert!(
        e.starts_with("invalid argument: no usable RoCE v2 GID: "),
        "{e}"
    );
    assert!(
        e.contains("mlx5_0 port 1 is not selected by ROCCL_IB_HCA=mlx5_1:2"),
        "{e}"
    );
    assert!(
        e.contains("mlx5_1 port 1 is not selected by ROCCL_IB_HCA=mlx5_1:2"),
        "{e}"
    );
    assert!(e.contains("ports found: mlx5_0:1, mlx5_1:1"), "{e}");
}

/// A list of several NICs gives a device for each one that qualifies; one name, an
/// exclusion or no list gives the one `choose` picks.
#[test]
fn several_nics_listed_are_each_chosen() {
    let each = |vars: &[(&str, &str)]| -> Vec<(String, IpAddr)> {
        choose_each(&tree("two_nics"), &env(vars).unwrap())
            .unwrap()
            .into_iter()
            .map(|c| (c.dev, c.gid.ip()))
            .collect()
    };
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert_eq!(
        each(&[(HCA_VAR, "mlx5_1,mlx5_0")]),
        [
            ("mlx5_0".to_string(), ip("10.0.0.5")),
            ("mlx5_1".to_string(), ip("10.1.0.5"))
        ]
    );
    assert_eq!(each(&[]), [("mlx5_0".to_string(), ip("10.0.0.5"))]);
    assert_eq!(each(&[(HCA_VAR, "^mlx5_0")]).len(), 1);
    assert_eq!(each(&[(HCA_VAR, "mlx5_1")]).len(), 1);
    // One of the listed does not qualify (no GID in the range): the others are used.
    assert_eq!(
        each(&[(HCA_VAR, "mlx5_0,mlx5_1"), (RANGE_VAR, "10.1.0.0/16")]),
        [("mlx5_1".to_string(), ip("10.1.0.5"))]
    );
    // None does: choose's error, with the reasons.
    let e = choose_each(
        &tree("two_nics"),
        &env(&[(HCA_VAR, "mlx5_0,mlx5_1"), (RANGE_VAR, "10.9.0.0/16")]).unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no usable RoCE v2 GID"), "{e}");
}

#[test]
fn range_skips_addresses_outside() {
    // A hand-built port with two IPv4 addresses on one netdev.
    let entry = |index: u32, ip: &str| GidEntry {
        index,
        gid: format!("::ffff:{ip}").parse().unwrap(),
        roce_v2: true,
        ndev: Some("eth1".to_string()),
    };
    let port = PortInfo {
        dev: "irdma1".to_string(),
        port: 1,
        state: "ACTIVE".to_string(),
        active: true,
        link_layer: "Ethernet".to_string(),
        ethernet: true,
        rate_gbps: None,
        pci: None,
        node_guid: None,
        netdev_mtu: None,
        gids: vec![entry(0, "172.16.0.4"), entry(1, "10.2.0.4")],
        unreadable: vec![],
    };
    let ports = [port];
    assert_eq!(choose(&ports, &Criteria::default()).unwrap().gid_index, 0);
    let c = choose(&ports, &env(&[(RANGE_VAR, "10.2.0.0/16")]).unwrap()).unwrap();
    assert_eq!(c.gid_index, 1);
    assert_eq!(
        c.why,
        "irdma1 port 1 GID 1: RoCE v2, IPv4 10.2.0.4 on eth1 (GID 0 is outside 10.2.0.0/16)"
    );
}

#[test]
fn unreadable_runs_are_merged() {
    // A kernel may refuse every unused slot of a 256-entry table: keep messages short.
    let mut ports = tree("e810");
    ports[0].unreadable = (2..=255).collect();
    let e = err_text(choose(&ports, &env(&[(FAMILY_VAR, "ipv6")]).unwrap()));
    assert!(e.contains("1 10.1.0.11 RoCE v2, 2-255 unreadable)"), "{e}");
    let table = describe(&ports, None);
    assert_eq!(table.matches("unreadable").count(), 1, "{table}");
    assert!(table.contains("2-255"), "{table}");
    let e = err_text(choose(&ports, &env(&[(GID_INDEX_VAR, "300")]).unwrap()));
    assert!(
        e.contains("(readable indices: 0-1; unreadable: 2-255)"),
        "{e}"
    );
}

#[test]
fn device_order_is_numeric() {
    assert_eq!(natural_cmp("mlx5_2", "mlx5_10"), Ordering::Less);
    assert_eq!(natural_cmp("mlx5_10", "mlx5_9"), Ordering::Greater);
    assert_eq!(natural_cmp("irdma0", "mlx5_0"), Ordering::Less);
    assert_eq!(natural_cmp("mlx5_0", "mlx5_0"), Ordering::Equal);
    assert_eq!(natural_cmp("mlx5", "mlx5_0"), Ordering::Less);
    assert_ne!(natural_cmp("a01", "a1"), Ordering::Equal);
    // choose() follows that order whatever order it is given.
    let mut ports = tree("two_nics");
    ports.reverse();
    assert_eq!(choose(&ports, &Criteria::default()).unwrap().dev, "mlx5_0");
}

#[test]
fn infiniband_and_down() {
    let ports = tree("infiniband");
    assert!(!ports[0].ethernet && ports[0].active);
    assert!(ports[1].ethernet && !ports[1].active);
    assert_eq!(ports[1].state, "DOWN");
    let e = err_text(choose(&ports, &Criteria::default()));
    assert!(
        e.contains("mlx5_0 port 1 is InfiniBand, not Ethernet"),
        "{e}"
    );
    assert!(e.contains("mlx5_1 port 1 is DOWN"), "{e}");
    assert!(e.contains("Fix: "), "{e}");
    assert!(e.contains("bring the port up"), "{e}");
    assert!(e.contains("InfiniBand links"), "{e}");
    assert!(e.ends_with('.'), "{e}");
    let table = describe(&ports, None);
    assert!(
        table.contains("mlx5_0 port 1: ACTIVE, InfiniBand"),
        "{table}"
    );
    assert!(table.contains(" IB "), "{table}");
}

#[test]
fn no_ports() {
    let e = err_text(choose(&[], &Criteria::default()));
    assert!(e.contains("no RDMA device found"), "{e}");
    assert!(describe(&[], None).contains("no RDMA device found"));
}

#[test]
fn forced_gid_index() {
    // Exists: taken even though it is RoCE v1, with a warning.
    let c = pick("mlx5", &[(GID_INDEX_VAR, "2")]).unwrap();
    assert_eq!(c.gid_index, 2);
    assert!(
        c.why.contains("forced by ROCCL_IB_GID_INDEX, RoCE v1"),
        "{}",
        c.why
    );
    assert!(c.why.contains("warning: not RoCE v2"), "{}", c.why);
    // The family is not applied to a forced index.
    let c = pick("mlx5", &[(GID_INDEX_VAR, "5")]).unwrap();
    assert_eq!(c.gid.ip(), "fd00::2".parse::<IpAddr>().unwrap());
    // -1 means automatic.
    assert_eq!(pick("mlx5", &[(GID_INDEX_VAR, "-1")]).unwrap().gid_index, 3);
    // Missing (9) and unused (6, all zeros).
    for i in ["9", "6"] {
        let e = err_text(pick("mlx5", &[(GID_INDEX_VAR, i)]));
        assert!(
            e.contains(&format!("no usable GID at ROCCL_IB_GID_INDEX={i}")),
            "{e}"
        );
        assert!(
            e.contains(&format!(
                "mlx5_0 port 1 has no GID at index {i} (readable indices: 0-5)"
            )),
            "{e}"
        );
    }
    // Unreadable.
    let e = err_text(pick("container", &[(GID_INDEX_VAR, "2")]));
    assert!(e.contains("mlx5_0 port 1 cannot read GID 2"), "{e}");
    assert!(
        e.contains("set ROCCL_IB_GID_INDEX to a readable index"),
        "{e}"
    );
    // Forced on two NICs: the first allowed port wins.
    let c = pick("two_nics", &[(GID_INDEX_VAR, "3"), (HCA_VAR, "mlx5_1")]).unwrap();
    assert_eq!((c.dev.as_str(), c.gid_index), ("mlx5_1", 3));
}

#[test]
fn hca_parsing() {
    let f = parse_hca("mlx5_1").unwrap();
    assert!(f.allows("mlx5_1", 1) && f.allows("mlx5_10", 2));
    assert!(!f.allows("mlx5_0", 1));
    let f = parse_hca("=mlx5_1").unwrap();
    assert!(f.allows("mlx5_1", 1) && !f.allows("mlx5_10", 1));
    let f = parse_hca("^mlx5_0").unwrap();
    assert!(f.is_exclude());
    assert!(!f.allows("mlx5_0", 1) && !f.allows("mlx5_01", 1) && f.allows("mlx5_1", 1));
    let f = parse_hca("^=mlx5_0").unwrap();
    assert!(!f.allows("mlx5_0", 1) && f.allows("mlx5_01", 1));
    let f = parse_hca(" mlx5_0:1 , irdma ,").unwrap();
    assert_eq!(f.spec(), "mlx5_0:1 , irdma ,");
    assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
    assert!(f.allows("irdma0", 1) && f.allows("irdma1", 2));
    let f = parse_hca("^mlx5_0:2").unwrap();
    assert!(f.allows("mlx5_0", 1) && !f.allows("mlx5_0", 2));
    assert_eq!(f.to_string(), "^mlx5_0:2");

    for (bad, what) in [
        ("", "names no device"),
        ("^", "names no device"),
        ("^=", "names no device"),
        (",", "names no device"),
        ("mlx5_0:x", "is not a port number"),
        ("mlx5_0:0", "is not a port number"),
        ("mlx5_0:", "is not a port number"),
        (":1", "has no device name"),
        ("=^mlx5_0", "'^' and '=' may only start"),
        ("mlx5_0,^mlx5_1", "'^' and '=' may only start"),
        ("mlx5 0", "is not a device name"),
    ] {
        let e = parse_hca(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        let e = e.to_string();
        assert!(e.contains("ROCCL_IB_HCA="), "{bad:?}: {e}");
        assert!(e.contains(what), "{bad:?}: {e}");
    }
}

#[test]
fn cidr_parsing() {
    let c = parse_cidr("10.0.0.0/16").unwrap();
    assert_eq!(c.to_string(), "10.0.0.0/16");
    assert_eq!(c.family(), Family::V4);
    assert!(c.contains("10.0.255.1".parse().unwrap()));
    assert!(!c.contains("10.1.0.1".parse().unwrap()));
    assert!(c.contains("::ffff:10.0.0.9".parse().unwrap()));
    assert!(!c.contains("fd00::1".parse().unwrap()));
    let c = parse_cidr(" 10.1.2.3/16 ").unwrap();
    assert_eq!(c.addr(), "10.1.0.0".parse::<IpAddr>().unwrap());
    assert_eq!(c.prefix(), 16);
    let c: Cidr = "fd00::/64".parse().unwrap();
    assert_eq!(c.family(), Family::V6);
    assert!(c.contains("fd00::2".parse().unwrap()));
    assert!(!c.contains("fd00:0:0:1::2".parse().unwrap()));
    assert!(!c.contains("10.0.0.1".parse().unwrap()));
    let all = parse_cidr("0.0.0.0/0").unwrap();
    assert!(all.contains("255.255.255.255".parse().unwrap()));
    let host = parse_cidr("10.0.0.5/32").unwrap();
    assert!(host.contains("10.0.0.5".parse().unwrap()));
    assert!(!host.contains("10.0.0.4".parse().unwrap()));
    assert!(parse_cidr("::/0")
        .unwrap()
        .contains("fd00::1".parse().unwrap()));
    assert!(parse_cidr("fd00::1/128")
        .unwrap()
        .contains("fd00::1".parse().unwrap()));

    for (bad, what) in [
        ("10.0.0.0", "has no prefix length"),
        ("10.0.0/8", "does not start with an IP address"),
        ("eth0/8", "does not start with an IP address"),
        ("10.0.0.0/x", "bad prefix length"),
        ("10.0.0.0/33", "longer than its address"),
        ("fd00::/129", "longer than its address"),
        ("", "has no prefix length"),
    ] {
        let e = parse_cidr(bad).unwrap_err().to_string();
        assert!(e.contains("ROCCL_IB_ADDR_RANGE="), "{bad:?}: {e}");
        assert!(e.contains(what), "{bad:?}: {e}");
    }
}

#[test]
fn family_parsing() {
    for v in ["AF_INET", "af_inet", "ipv4", "IPv4", " inet ", "4"] {
        assert_eq!(parse_family(v).unwrap(), Family::V4, "{v}");
    }
    for v in ["AF_INET6", "ipv6", "IPV6", "inet6", "6"] {
        assert_eq!(v.parse::<Family>().unwrap(), Family::V6, "{v}");
    }
    for v in ["", "AF_UNIX", "ipv5", "any"] {
        let e = parse_family(v).unwrap_err().to_string();
        assert!(e.contains("ROCCL_IB_ADDR_FAMILY="), "{e}");
        assert!(e.contains("AF_INET6"), "{e}");
    }
    assert_eq!(Family::default(), Family::V4);
}

#[test]
fn criteria_from_env() {
    assert_eq!(env(&[]).unwrap(), Criteria::default());
    // Blank values count as unset.
    assert_eq!(
        env(&[(HCA_VAR, " "), (GID_INDEX_VAR, "")]).unwrap(),
        Criteria::default()
    );
    let c = env(&[
        (HCA_VAR, "=mlx5_1:1"),
        (GID_INDEX_VAR, " 3 "),
        (FAMILY_VAR, "AF_INET"),
        (RANGE_VAR, "10.1.0.0/16"),
    ])
    .unwrap();
    assert_eq!(c.hca.as_ref().map(|h| h.spec()), Some("=mlx5_1:1"));
    assert_eq!(c.gid_index, Some(3));
    assert_eq!(c.family, Family::V4);
    assert_eq!(c.range, Some(parse_cidr("10.1.0.0/16").unwrap()));
    // The family follows the range when not given.
    assert_eq!(env(&[(RANGE_VAR, "fd00::/64")]).unwrap().family, Family::V6);
    assert_eq!(env(&[(GID_INDEX_VAR, "-1")]).unwrap().gid_index, None);

    for (vars, name) in [
        (vec![(HCA_VAR, "^")], HCA_VAR),
        (vec![(GID_INDEX_VAR, "three")], GID_INDEX_VAR),
        (vec![(GID_INDEX_VAR, "-2")], GID_INDEX_VAR),
        (vec![(FAMILY_VAR, "AF_UNIX")], FAMILY_VAR),
        (vec![(RANGE_VAR, "10.0.0.0")], RANGE_VAR),
        (
            vec![(FAMILY_VAR, "ipv4"), (RANGE_VAR, "fd00::/64")],
            RANGE_VAR,
        ),
    ] {
        let e = env(&vars).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        let e = e.to_string();
        assert!(e.contains(name), "{vars:?}: {e}");
    }
    // A hand-built mismatch is refused by choose() too.
    let c = Criteria {
        range: Some(parse_cidr("fd00::/64").unwrap()),
        ..Criteria::default()
    };
    let e = err_text(choose(&tree("mlx5"), &c));
    assert!(
        e.contains("IPv6 range but the wanted family is IPv4"),
        "{e}"
    );
}

#[test]
fn describe_marks_choice() {
    let ports = tree("mlx5");
    let c = choose(&ports, &Criteria::default()).unwrap();
    let table = describe(&ports, Some(&c));
    assert!(table.starts_with("mlx5_0 port 1: ACTIVE, Ethernet, 100 Gb/s, pci 0000:17:00.0, netdev ens1f0np0 mtu 9000, guid b8ce:f603:00a2:b4a0\n"), "{table}");
    let marked: Vec<&str> = table.lines().filter(|l| l.contains("<- chosen")).collect();
    assert_eq!(marked.len(), 1, "{table}");
    assert!(marked[0].trim_start().starts_with("=> 3"), "{table}");
    assert!(marked[0].contains("192.168.1.2"), "{table}");
    assert!(table.contains("fd00::2"), "{table}");
    assert!(table.ends_with(&format!("chosen: {}\n", c.why)), "{table}");
    let plain = describe(&ports, None);
    assert!(!plain.contains("<- chosen") && plain.ends_with("chosen: none\n"));
    // Several devices, one without the choice.
    let ports = tree("two_nics");
    let c = pick("two_nics", &[(HCA_VAR, "mlx5_1")]).unwrap();
    let table = describe(&ports, Some(&c));
    assert!(table.contains("mlx5_0 port 1:") && table.contains("mlx5_1 port 1:"));
    assert_eq!(table.matches("<- chosen").count(), 1, "{table}");
    let chosen = table.lines().find(|l| l.contains("<- chosen")).unwrap();
    assert!(chosen.contains("10.1.0.5"), "{table}");
}

#[test]
fn gid_entry_ip() {
    let g = |s: &str| GidEntry {
        index: 0,
        gid: s.parse().unwrap(),
        roce_v2: true,
        ndev: None,
    };
    assert_eq!(
        g("::ffff:192.168.1.2").ip(),
        "192.168.1.2".parse::<IpAddr>().unwrap()
    );
    assert_eq!(g("fd00::2").ip(), "fd00::2".parse::<IpAddr>().unwrap());
    assert!(g("fe80::1").is_link_local() && g("febf::1").is_link_local());
    assert!(!g("fec0::1").is_link_local());
    assert!(g("::").is_zero());
}

#[test]
fn attribute_parsing() {
    assert_eq!(parse_state("4: ACTIVE"), ("ACTIVE".to_string(), true));
    assert_eq!(parse_state("1: DOWN"), ("DOWN".to_string(), false));
    assert_eq!(
        parse_state("5: ACTIVE_DEFER"),
        ("ACTIVE_DEFER".to_string(), false)
    );
    assert_eq!(parse_state(""), ("unknown".to_string(), false));
    assert_eq!(parse_rate("100 Gb/sec (4X EDR)"), Some(100.0));
    assert_eq!(parse_rate("2.5 Gb/sec (1X SDR)"), Some(2.5));
    assert_eq!(parse_rate("garbage"), None);
    assert_eq!(parse_rate("0 Gb/sec"), None);
    assert_eq!(index_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
}

#[test]
fn missing_root_is_empty() {
    let root = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/sysfs/nonexistent"
    ));
    assert!(scan(root).unwrap().is_empty());
    // A file where the root should be is an error naming it.
    let file = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
    let e = scan(file).unwrap_err();
    assert!(e.to_string().contains("Cargo.toml"), "{e}");
}

#[test]
fn real_sysfs_smoke() {
    // The scan of this machine's sysfs finds exactly the ports listed there (none
    // without RDMA hardware, each device's ports/N on a RoCE host), and the report
    // names each of them.
    let root = Path::new(SYSFS_ROOT);
    let ports = scan(root).unwrap();
    let listed: usize = std::fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_dir(e.path().join("ports")).ok())
                .map(|p| p.count())
                .sum()
        })
        .unwrap_or(0);
    assert_eq!(ports.len(), listed, "{ports:?}");
    let text = describe(&ports, None);
    for p in &ports {
        assert!(text.contains(&p.dev), "{} missing from: {text}", p.dev);
    }
    if ports.is_empty() {
        eprintln!("real_sysfs_smoke: no RDMA ports in {SYSFS_ROOT} (none on this host)");
    }
}
