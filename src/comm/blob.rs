//! The blob each rank registers at the rendezvous: its network and handles, the settings
//! that decide how a call is cut into messages (refused at init where they differ from this
//! rank's, naming the setting, both values and both ranks: two ranks that cut a call
//! differently could pair messages of equal size at different offsets and sum the wrong
//! bytes, silently), the inputs of the cost model that differ by host, its process and its
//! spare rendezvous listener. `agree.rs` combines the blobs.

use super::config::EXTRA_NETS;
use super::Config;
use crate::algo::calibrate::{self, HostSpeeds};
use crate::algo::Algo;
use crate::bootstrap;
use crate::error::{Error, Result};
use crate::net::{NetHandle, HANDLE_MAX};

pub(super) const VERSION: u32 = 13;

/// The settings every rank must share, in blob order.
pub(super) const SETTINGS: [&str; 12] = [
    "ROCCL_ALGO",
    "ROCCL_RING_WINDOW",
    "ROCCL_SLICE",
    "ROCCL_DEPTH",
    "ROCCL_NCHANNELS",
    "ROCCL_STREAM_CHUNK",
    "ROCCL_SHM_SLOT",
    "ROCCL_GPU_DIRECT",
    "ROCCL_GPU_DIRECT_MIN",
    "ROCCL_HIER",
    "ROCCL_DETERMINISTIC",
    "ROCCL_MEASURE",
];
/// An unset setting (the cost model decides).
pub(super) const UNSET: u64 = u64::MAX;

/// Algorithms by their number in the blob and in call tags.
pub(super) const ALGOS: [Algo; Algo::ALL.len()] = Algo::ALL;

/// Bytes: version, host id, network name, its handle, flags (shared-memory handle, node
/// segment), padding, the shared-memory handle, measured speeds, settings, host inputs, the
/// process (pid and pid namespace: a peer of the same host can tell its state), the spare
/// rendezvous listener (`bootstrap::spare`), the networks offered beside the main one
/// (`ROCCL_NETS`: a flag and a handle per network of [`EXTRA_NETS`]).
pub(super) const BLOB_LEN: usize = 4
    + 8
    + 16
    + HANDLE_MAX
    + 8
    + HANDLE_MAX
    + 8
    + 8 * SETTINGS.len()
    + HOST_LEN
    + PROC_LEN
    + SPARE_LEN
    + EXTRA_LEN;
pub(super) const AT_FLAGS: usize = 28 + HANDLE_MAX;
pub(super) const AT_SHM: usize = AT_FLAGS + 8;
pub(super) const AT_SPEEDS: usize = AT_SHM + HANDLE_MAX;
pub(super) const AT_SETTINGS: usize = AT_SPEEDS + 8;
pub(super) const AT_HOST: usize = AT_SETTINGS + 8 * SETTINGS.len();
pub(super) const HOST_LEN: usize = 24;
pub(super) const AT_PROC: usize = AT_HOST + HOST_LEN;
pub(super) const PROC_LEN: usize = 12;
pub(super) const AT_SPARE: usize = AT_PROC + PROC_LEN;
pub(super) const SPARE_LEN: usize = 24;
pub(super) const AT_EXTRA: usize = AT_SPARE + SPARE_LEN;
pub(super) const EXTRA_LEN: usize = 8 + EXTRA_NETS.len() * HANDLE_MAX;

/// The values of [`SETTINGS`] for `cfg`.
pub(super) fn settings(cfg: &Config, stream_chunk: usize) -> [u64; SETTINGS.len()] {
    let opt = |v: Option<usize>| v.map_or(UNSET, |v| v as u64);
    [
        cfg.algo
            .and_then(|a| ALGOS.iter().position(|&x| x == a))
            .map_or(UNSET, |i| i as u64),
        cfg.ring_window as u64,
        opt(cfg.tuning.slice),
        opt(cfg.tuning.depth),
        opt(cfg.tuning.channels),
        stream_chunk as u64,
        opt(cfg.shm_slot),
        cfg.gpu_direct as u64,
        cfg.gpu_direct_min as u64,
        cfg.hier as u64,
        u64::from(cfg.deterministic),
        u64::from(cfg.measure_links),
    ]
}

/// A setting's value as a user would write it.
pub(super) fn show(setting: usize, v: u64) -> String {
    match (setting, v) {
        (0, UNSET) => "auto (unset)".into(),
        (0, i) => ALGOS
            .get(i as usize)
            .map_or("?".into(), |a| a.name().into()),
        (7, 0) => "0".into(),
        (7, 1) => "auto".into(),
        (7, _) => "1".into(),
        (9, 0) => "0".into(),
        (9, 1) => "auto".into(),
        (9, _) => "1".into(),
        (10 | 11, v) => v.to_string(),
        (_, UNSET) => "unset".into(),
        (_, v) => v.to_string(),
    }
}

/// What differs by host among the cost model's inputs (besides the measured speeds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct HostInputs {
    /// CPU cores of the host.
    pub cores: u32,
    /// The network's one-way latency of a small message, µs.
    pub latency_us: f32,
    /// The network's link speed, Mbit/s.
    pub speed_mbps: u32,
    /// Which NIC the rank uses (a fingerprint of the network device's name, GUID and PCI
    /// path): ranks of one host on different NICs spread the traffic between hosts.
    pub nic: u64,
    /// The network's devices (NICs) this rank spreads its channels over.
    pub devices: u32,
}

/// One rank's registration, as every rank reads it.
#[derive(Debug)]
pub(super) struct Blob {
    pub host: u64,
    pub handle: NetHandle,
    pub shm: Option<NetHandle>,
    pub node: bool,
    pub speeds: HostSpeeds,
    pub inputs: HostInputs,
    /// Its process id and pid namespace.
    pub pid: u32,
    pub pid_ns: u64,
    /// Its spare rendezvous listener (shrink and grow), if it could bind one.
    pub spare: Option<std::net::SocketAddr>,
    /// Its handles on the networks it offers beside the main one, by [`EXTRA_NETS`].
    pub extras: [Option<NetHandle>; EXTRA_NETS.len()],
}

/// This rank's blob.
#[allow(clippy::too_many_arguments)]
pub(super) fn blob(
    handle: &NetHandle,
    net: &str,
    shm: Option<&NetHandle>,
    node: bool,
    settings: &[u64; SETTINGS.len()],
    (inputs, speeds): (HostInputs, HostSpeeds),
    (spare, extras): (
        Option<std::net::SocketAddr>,
        &[Option<NetHandle>; EXTRA_NETS.len()],
    ),
    host: u64,
) -> Vec<u8> {
    let mut b = Vec::with_capacity(BLOB_LEN);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&host.to_le_bytes());
    let mut name = [0u8; 16];
    name[..net.len().min(16)].copy_from_slice(&net.as_bytes()[..net.len().min(16)]);
    b.extend_from_slice(&name);
    b.extend_from_slice(handle.as_bytes());
    b.extend_from_slice(&[u8::from(shm.is_some()), u8::from(node), 0, 0, 0, 0, 0, 0]);
    b.extend_from_slice(shm.map_or(&[0u8; HANDLE_MAX], |h| h.as_bytes()));
    b.extend_from_slice(&calibrate::encode(speeds));
    for v in settings {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&inputs.cores.to_le_bytes());
    b.extend_from_slice(&inputs.latency_us.to_le_bytes());
    b.extend_from_slice(&inputs.speed_mbps.to_le_bytes());
    b.extend_from_slice(&inputs.nic.to_le_bytes());
    b.extend_from_slice(&inputs.devices.to_le_bytes());
    b.extend_from_slice(&std::process::id().to_le_bytes());
    b.extend_from_slice(&crate::os::process::pid_namespace().to_le_bytes());
    b.extend_from_slice(&bootstrap::spare::encode_addr(spare));
    let mut flags = [0u8; 8];
    for (f, h) in flags.iter_mut().zip(extras) {
        *f = u8::from(h.is_some());
    }
    b.extend_from_slice(&flags);
    for h in extras {
        b.extend_from_slice(h.as_ref().map_or(&[0u8; HANDLE_MAX], |h| h.as_bytes()));
    }
    debug_assert_eq!(b.len(), BLOB_LEN);
    b
}

/// Whether ranks on networks `a` and `b` can form one job: the same network, or RoCE v2
/// through either provider — a NIC (`verbs`) and the userspace engine (`rocev2`) speak one
/// wire protocol, so a host without an RDMA NIC joins hosts that have one. What they cannot
/// share (a NIC reaches an engine only on UDP port 4791) is refused at connection setup.
pub(super) fn networks_meet(a: &str, b: &str) -> bool {
    const ROCE_V2: [&str; 2] = ["rocev2", "verbs"];
    a == b || (ROCE_V2.contains(&a) && ROCE_V2.contains(&b))
}

pub(super) fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Rank `rank`'s blob, checked against this rank (`me`, network `my_net`, `mine`: this
/// rank's settings).
pub(super) fn parse_blob(
    rank: usize,
    b: &[u8],
    me: usize,
    my_net: &str,
    mine: &[u64; SETTINGS.len()],
) -> Result<Blob> {
    if b.len() != BLOB_LEN || word(b, 0) != VERSION {
        return Err(Error::InvalidUsage(format!(
            "rank {rank} registered in an unknown format: are all ranks running the same roccl version?"
        )));
    }
    let name = std::str::from_utf8(&b[12..28])
        .unwrap_or("?")
        .trim_end_matches('\0');
    if !networks_meet(name, my_net) {
        return Err(Error::InvalidUsage(format!(
            "rank {rank} uses network '{name}' but rank {me} uses '{my_net}': set the same ROCCL_NET (or the same first network of ROCCL_NETS) everywhere"
        )));
    }
    for (i, setting) in SETTINGS.iter().enumerate() {
        let at = AT_SETTINGS + 8 * i;
        let theirs = u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if theirs != mine[i] {
            return Err(Error::InvalidUsage(format!(
                "rank {rank} runs with {setting}={} but rank {me} with {setting}={}: it decides how calls are cut into messages, so it must be the same on every rank",
                show(i, theirs),
                show(i, mine[i])
            )));
        }
    }
    let shm = if b[AT_FLAGS] != 0 {
        Some(NetHandle::from_bytes(&b[AT_SHM..AT_SPEEDS])?)
    } else {
        None
    };
    Ok(Blob {
        host: u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")),
        handle: NetHandle::from_bytes(&b[28..AT_FLAGS])?,
        shm,
        node: b[AT_FLAGS + 1] != 0,
        speeds: calibrate::decode(&b[AT_SPEEDS..AT_SETTINGS]),
        inputs: HostInputs {
            cores: word(b, AT_HOST),
            latency_us: f32::from_le_bytes(b[AT_HOST + 4..AT_HOST + 8].try_into().expect("4")),
            speed_mbps: word(b, AT_HOST + 8),
            nic: u64::from_le_bytes(b[AT_HOST + 12..AT_HOST + 20].try_into().expect("8 bytes")),
            devices: word(b, AT_HOST + 20),
        },
        pid: word(b, AT_PROC),
        pid_ns: u64::from_le_bytes(b[AT_PROC + 4..AT_PROC + 12].try_into().expect("8 bytes")),
        spare: bootstrap::spare::decode_addr(&b[AT_SPARE..AT_SPARE + SPARE_LEN]),
        extras: extra_handles(b)?,
    })
}

/// The handles of a blob's extra networks ([`Blob::extras`]).
fn extra_handles(b: &[u8]) -> Result<[Option<NetHandle>; EXTRA_NETS.len()]> {
    let mut out: [Option<NetHandle>; EXTRA_NETS.len()] = Default::default();
    for (i, h) in out.iter_mut().enumerate() {
        if b[AT_EXTRA + i] != 0 {
            let at = AT_EXTRA + 8 + i * HANDLE_MAX;
            *h = Some(NetHandle::from_bytes(&b[at..at + HANDLE_MAX])?);
        }
    }
    Ok(out)
}

/// A blob of this rank with network `net` and its `handle`, under the settings of the
/// environment: a seed of the fuzz targets' corpus.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seed_blob(
    handle: &NetHandle,
    net: &str,
    shm: Option<&NetHandle>,
) -> Result<Vec<u8>> {
    let cfg = Config::from_env()?;
    let mine = settings(&cfg, super::stream::ops::stream_chunk()?);
    let inputs = HostInputs {
        cores: 2,
        latency_us: 20.0,
        speed_mbps: 10_000,
        nic: 0,
        devices: 1,
    };
    Ok(blob(
        handle,
        net,
        shm,
        false,
        &mine,
        (inputs, calibrate::REFERENCE),
        (None, &Default::default()),
        bootstrap::host_id(),
    ))
}

/// [`HostInputs::nic`] for a network device.
pub(super) fn nic_fingerprint(p: &crate::net::NetProperties) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same value in every rank's process.
    let mut h = std::hash::DefaultHasher::new();
    (&p.name, p.guid, &p.pci_path).hash(&mut h);
    h.finish()
}
