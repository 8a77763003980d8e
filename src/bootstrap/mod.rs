//! Bootstrap: unique ids, rendezvous through a root, launcher environments, interface choice.
//!
//! A [`UniqueId`] (128 bytes) holds the address of a *root*: a small TCP server that
//! collects one registration per rank — its rank, the communicator size and an opaque
//! blob (host identity, network listen handles) — and, once all `nranks` have arrived,
//! sends every rank the table of all blobs. If the timeout passes first, every waiting
//! rank gets an error that lists the ranks that never arrived.
//!
//! Wire format (all little endian). Registration: `magic u32 "RBST"`, `nonce u64`,
//! `rank u32`, `nranks u32`, `blob_len u32`, `timeout_ms u32`, blob. The root gives up
//! `timeout_ms` (the smallest any rank sent) after the first registration. Reply: `status u8` (0 ok, 1 error);
//! ok: `n × (len u32, bytes)`; error: `len u32`, UTF-8 message.

pub mod env;
pub mod ifaces;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const ID_MAGIC: u32 = 0x4449_4352; // "RCID"
const REG_MAGIC: u32 = 0x5453_4252; // "RBST"
const MAX_BLOB: usize = 1 << 20;

/// Size of a unique id in bytes (as `NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Opaque id of a communicator being created: the root's address and a nonce. Create it on
/// one rank with [`UniqueId::new`] and pass its bytes to every rank out of band.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.root() {
            Ok((a, n)) => write!(f, "UniqueId(root {a}, nonce {n:016x})"),
            Err(_) => write!(f, "UniqueId(invalid)"),
        }
    }
}

fn nonce() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ ((std::process::id() as u64) << 32) ^ (&t as *const u64 as u64);
    // splitmix64 finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl UniqueId {
    /// Start a root in this process (a background thread that serves one communicator's
    /// rendezvous, then exits) on the interface chosen by `ROCCL_SOCKET_IFNAME`, and return
    /// its id.
    pub fn new() -> Result<UniqueId> {
        let ip = ifaces::local_addr(None)?;
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::sys(format!("bind the bootstrap root on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname of the bootstrap root", e))?;
        let id = UniqueId::from_parts(addr, nonce());
        spawn_root(l, id.nonce());
        Ok(id)
    }

    /// An id for a root at `addr` that some process serves with [`serve_root`] (environment
    /// launch: rank 0 serves the root at `ROCCL_ROOT` / `MASTER_ADDR`). The nonce is fixed, so
    /// every rank computes the same id from the address alone.
    pub fn for_address(addr: SocketAddr) -> UniqueId {
        UniqueId::from_parts(addr, 0x726f_6363_6c00_0000 ^ addr.port() as u64)
    }

    fn from_parts(addr: SocketAddr, nonce: u64) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(&ID_MAGIC.to_le_bytes());
        b[6..8].copy_from_slice(&addr.port().to_le_bytes());
        match addr.ip() {
            IpAddr::V4(v) => {
                b[4] = 4;
                b[8..12].copy_from_slice(&v.octets());
            }
            IpAddr::V6(v) => {
                b[4] = 6;
                b[8..24].copy_from_slice(&v.octets());
            }
        }
        b[24..32].copy_from_slice(&nonce.to_le_bytes());
        UniqueId { bytes: b }
    }

    /// Rebuild an id from its bytes; checks the format.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; UNIQUE_ID_BYTES] = b.try_into().map_err(|_| {
            Error::arg(format!(
                "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                b.len()
            ))
        })?;
        let id = UniqueId { bytes };
        id.root()?;
        Ok(id)
    }

    /// Parse the 256-hex-digit form (as in `ROCCL_UNIQUE_ID`).
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * UNIQUE_ID_BYTES || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::arg(format!(
                "a unique id in hex is {} hex digits, got {:?}",
                2 * UNIQUE_ID_BYTES,
                s.chars().take(16).collect::<String>()
            )));
        }
        let mut b = [0u8; UNIQUE_ID_BYTES];
        for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
            let h =
                std::str::from_utf8(chunk).map_err(|_| Error::arg("unique id hex is not ASCII"))?;
            b[i] =
                u8::from_str_radix(h, 16).map_err(|_| Error::arg("unique id hex is malformed"))?;
        }
        UniqueId::from_bytes(&b)
    }

    /// The 256-hex-digit form.
    pub fn to_hex(&self) -> String {
        self.bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    /// Root address and nonce.
    pub fn root(&self) -> Result<(SocketAddr, u64)> {
        let b = &self.bytes;
        if u32::from_le_bytes(b[0..4].try_into().unwrap()) != ID_MAGIC {
            return Err(Error::arg(
                "not a roccl unique id (bad magic): pass the bytes produced by UniqueId::new / rocclGetUniqueId unchanged",
            ));
        }
        let port = u16::from_le_bytes([b[6], b[7]]);
        let ip: IpAddr = match b[4] {
            4 => <[u8; 4]>::try_from(&b[8..12]).unwrap().into(),
            6 => <[u8; 16]>::try_from(&b[8..24]).unwrap().into(),
            f => {
                return Err(Error::arg(format!(
                    "unique id has unknown address family {f}"
                )))
            }
        };
        Ok((SocketAddr::new(ip, port), self.nonce()))
    }

    fn nonce(&self) -> u64 {
        u64::from_le_bytes(self.bytes[24..32].try_into().unwrap())
    }
}

/// Serve the root of one communicator on `addr` in a background thread (environment
/// launch: rank 0 calls this with the agreed address before joining).
pub fn serve_root(addr: SocketAddr) -> Result<UniqueId> {
    let l = bind_retry(addr, Duration::from_secs(5))?;
    // Port 0 (a single rank with no agreed port) binds any free port: publish that one.
    let port = l.local_addr().map(|a| a.port()).unwrap_or(addr.port());
    let id = UniqueId::for_address(SocketAddr::new(addr.ip(), port));
    spawn_root(l, id.nonce());
    Ok(id)
}

fn bind_retry(addr: SocketAddr, max: Duration) -> Result<TcpListener> {
    let start = Instant::now();
    loop {
        let bind_addr = if addr.ip().is_loopback()
            || ifaces::list()
                .map(|l| l.iter().any(|i| i.addr == addr.ip()))
                .unwrap_or(false)
        {
            addr
        } else {
            // The root host name may resolve to an address not on a local interface (NAT,
            // aliases): listen on every address of this family instead.
            let any: IpAddr = if addr.is_ipv4() {
                [0u8; 4].into()
            } else {
                [0u8; 16].into()
            };
            SocketAddr::new(any, addr.port())
        };
        match TcpListener::bind(bind_addr) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && start.elapsed() < max => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(Error::sys(
                    format!("bind the bootstrap root on {bind_addr} (is the port free? set ROCCL_ROOT to another port)"),
                    e,
                ))
            }
        }
    }
}

struct Joined {
    stream: TcpStream,
    blob: Vec<u8>,
    /// Where its registration came from.
    from: SocketAddr,
}

fn spawn_root(l: TcpListener, nonce: u64) {
    std::thread::Builder::new()
        .name("roccl-root".into())
        .spawn(move || run_root(l, nonce))
        .expect("spawning the bootstrap root thread");
}

struct Reg {
    rank: usize,
    nranks: usize,
    blob: Vec<u8>,
    timeout: Duration,
}

fn read_reg(s: &mut TcpStream, nonce: u64) -> std::io::Result<Option<Reg>> {
    let mut h = [0u8; 28];
    s.read_exact(&mut h)?;
    let magic = u32::from_le_bytes(h[0..4].try_into().unwrap());
    let n = u64::from_le_bytes(h[4..12].try_into().unwrap());
    if magic != REG_MAGIC || n != nonce {
        return Ok(None);
    }
    let rank = u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize;
    let nranks = u32::from_le_bytes(h[16..20].try_into().unwrap()) as usize;
    let len = u32::from_le_bytes(h[20..24].try_into().unwrap()) as usize;
    let timeout = Duration::from_millis(u32::from_le_bytes(h[24..28].try_into().unwrap()) as u64);
    if len > MAX_BLOB {
        return Ok(None);
    }
    let mut blob = vec![0u8; len];
    s.read_exact(&mut blob)?;
    Ok(Some(Reg {
        rank,
        nranks,
        blob,
        timeout,
    }))
}

fn send_error(s: &mut TcpStream, msg: &str) {
    let mut out = vec![1u8];
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg.as_bytes());
    let _ = s.write_all(&out);
}

/// A root nobody registers with gives up after this long.
const ROOT_IDLE: Duration = Duration::from_secs(3600);

/// How often a bootstrap that is still waiting says so: every 5 s, or four times within a
/// shorter timeout.
pub fn progress_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(5))
}

/// Fail every rank that has joined, and the one whose registration is refused, with `msg`;
/// returns it, for the ranks that register later.
///
/// Highest rank first: the root usually runs inside rank 0's process, which exits as soon as
/// it reads the error, taking this thread with it; by then every other rank's error is in
/// its socket's send buffer, which the kernel still delivers.
fn fail_all(joined: &mut BTreeMap<usize, Joined>, s: &mut TcpStream, msg: String) -> String {
    send_error(s, &msg);
    for j in std::mem::take(joined).values_mut().rev() {
        send_error(&mut j.stream, &msg);
    }
    crate::warn!("bootstrap root: {msg}");
    msg
}

fn run_root(l: TcpListener, nonce: u64) {
    let mut start = Instant::now();
    let mut timeout = ROOT_IDLE;
    let mut first = true;
    let mut last_said = Instant::now();
    let at = l
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let _ = l.set_nonblocking(true);
    let mut joined: BTreeMap<usize, Joined> = BTreeMap::new();
    let mut nranks: Option<usize> = None;
    // The job was set up wrong: every rank gets this, also those that register later (until
    // the timeout), so that none waits out the timeout.
    let mut failed: Option<String> = None;
    loop {
        if let Some(n) = nranks {
            if joined.len() == n && failed.is_none() {
                break;
            }
        }
        if (first && start.elapsed() > ROOT_IDLE) || (failed.is_some() && start.elapsed() > timeout)
        {
            return;
        }
        let n = nranks.unwrap_or(0);
        let missing = || -> Vec<usize> { (0..n).filter(|r| !joined.contains_key(r)).collect() };
        if !first && failed.is_none() && start.elapsed() > timeout {
            let msg = format!(
                "bootstrap timed out after {:.0?} (ROCCL_TIMEOUT): {} of {n} ranks joined; {} never arrived (did they start, and do they use the same unique id / ROCCL_ROOT?)",
                timeout,
                joined.len(),
                crate::error::ranks_list(&missing())
            );
            for j in joined.values_mut() {
                send_error(&mut j.stream, &msg);
            }
            return;
        }
        if !first && failed.is_none() && last_said.elapsed() >= progress_interval(timeout) {
            last_said = Instant::now();
            let have: Vec<usize> = joined.keys().copied().collect();
            crate::warn!(
                "bootstrap root at {at}: after {:.0?}, {} of {n} ranks joined ({}); waiting for {} (gives up after {timeout:.0?}, ROCCL_TIMEOUT)",
                start.elapsed(),
                have.len(),
                crate::error::ranks_list(&have),
                crate::error::ranks_list(&missing()),
            );
        }
        match l.accept() {
            Ok((mut s, from)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = s.set_nodelay(true);
                let Ok(Some(Reg {
                    rank,
                    nranks: n,
                    blob,
                    timeout: t,
                })) = read_reg(&mut s, nonce)
                else {
                    continue;
                };
                if let Some(msg) = &failed {
                    send_error(&mut s, msg);
                    continue;
                }
                if first {
                    first = false;
                    start = Instant::now();
                    last_said = start;
                    timeout = t;
                } else {
                    timeout = timeout.min(t);
                }
                // A job set up wrong fails on every rank at once, naming what is wrong.
                let want = *nranks.get_or_insert(n);
                let refused = if n != want {
                    Some(format!("rank {rank} (from {from}) says there are {n} ranks but earlier ranks said {want}: every rank must pass the same nranks"))
                } else if rank >= n {
                    Some(format!(
                        "rank {rank} (from {from}) is out of range for {n} ranks"
                    ))
                } else {
                    joined.get(&rank).map(|j| format!(
                        "rank {rank} joined twice (from {} and from {from}): two processes were given the same rank; check the ranks the launcher hands out",
                        j.from
                    ))
                };
                if let Some(msg) = refused {
                    failed = Some(fail_all(&mut joined, &mut s, msg));
                    continue;
                }
                joined.insert(
                    rank,
                    Joined {
                        stream: s,
                        blob,
                        from,
                    },
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let mut table = vec![0u8];
    for j in joined.values() {
        table.extend_from_slice(&(j.blob.len() as u32).to_le_bytes());
        table.extend_from_slice(&j.blob);
    }
    for j in joined.values_mut() {
        let _ = j.stream.write_all(&table);
    }
}

/// Register with the root of `id` as `rank` of `nranks` with `blob`; returns every rank's
/// blob, indexed by rank. Retries the connection until the root is up or `timeout` passes.
pub fn rendezvous(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    blob: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    rendezvous_abortable(
        id,
        rank,
        nranks,
        blob,
        timeout,
        &std::sync::atomic::AtomicBool::new(false),
    )
}

/// How often a rank waiting for the root looks at its abort flag.
const ABORT_POLL: Duration = Duration::from_millis(100);

/// [`rendezvous`], ended within about 100 ms by `abort` (set from another thread,
/// e.g. by `rocclCommAbort` during a non-blocking init) with an error saying so.
pub fn rendezvous_abortable(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    blob: &[u8],
    timeout: Duration,
    abort: &std::sync::atomic::AtomicBool,
) -> Result<Vec<Vec<u8>>> {
    let aborted = || abort.load(std::sync::atomic::Ordering::Relaxed);
    let abort_error = || {
        Error::InvalidUsage(format!(
            "rank {rank}: initialization was aborted by the application while waiting for the bootstrap root"
        ))
    };
    if nranks == 0 {
        return Err(Error::arg("nranks must be at least 1"));
    }
    if rank >= nranks {
        return Err(Error::arg(format!(
            "rank {rank} is out of range: nranks is {nranks}"
        )));
    }
    let (addr, nonce) = id.root()?;
    let start = Instant::now();
    let mut last_said = start;
    let mut s = loop {
        if aborted() {
            return Err(abort_error());
        }
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => break s,
            Err(e) => {
                if last_said.elapsed() >= progress_interval(timeout) {
                    last_said = Instant::now();
                    crate::warn!(
                        "rank {rank}: after {:.0?}, still waiting for the bootstrap root at {addr} ({e}); gives up after {timeout:.0?} (ROCCL_TIMEOUT)",
                        start.elapsed()
                    );
                }
                if start.elapsed() > timeout {
                    return Err(Error::Timeout(format!(
                        "rank {rank} could not reach the bootstrap root at {addr} within {timeout:.0?}: {e} (is rank 0 / the process that created the id running, and is {addr} reachable from here?)"
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let _ = s.set_nodelay(true);
    let mut msg = Vec::with_capacity(28 + blob.len());
    msg.extend_from_slice(&REG_MAGIC.to_le_bytes());
    msg.extend_from_slice(&nonce.to_le_bytes());
    msg.extend_from_slice(&(rank as u32).to_le_bytes());
    msg.extend_from_slice(&(nranks as u32).to_le_bytes());
    msg.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    msg.extend_from_slice(&(timeout.as_millis().min(u32::MAX as u128) as u32).to_le_bytes());
    msg.extend_from_slice(blob);
    s.write_all(&msg).map_err(|e| {
        Error::sys(
            format!("sending rank {rank}'s registration to the root at {addr}"),
            e,
        )
    })?;
    let left = timeout.saturating_sub(start.elapsed()) + Duration::from_secs(5);
    let until = Instant::now() + left;
    // Short read timeouts: the abort flag is looked at between them.
    let _ = s.set_read_timeout(Some(ABORT_POLL));
    let rd = |s: &mut TcpStream, b: &mut [u8]| {
        let mut got = 0;
        while got < b.len() {
            match s.read(&mut b[got..]) {
                Ok(0) => {
                    return Err(Error::sys(
                        format!("reading the bootstrap reply from {addr} (the root exited?)"),
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    if aborted() {
                        return Err(abort_error());
                    }
                    if Instant::now() > until {
                        return Err(Error::Timeout(format!(
                            "rank {rank} waited {left:.0?} for the bootstrap root at {addr} to answer"
                        )));
                    }
                }
                Err(e) => {
                    return Err(Error::sys(
                        format!("reading the bootstrap reply from {addr} (the root exited?)"),
                        e,
                    ))
                }
            }
        }
        Ok(())
    };
    let mut st = [0u8; 1];
    rd(&mut s, &mut st)?;
    let mut len4 = [0u8; 4];
    if st[0] != 0 {
        rd(&mut s, &mut len4)?;
        let mut m = vec![0u8; (u32::from_le_bytes(len4) as usize).min(MAX_BLOB)];
        rd(&mut s, &mut m)?;
        let text = String::from_utf8_lossy(&m).into_owned();
        return Err(if text.contains("timed out") {
            Error::Timeout(text)
        } else {
            Error::InvalidUsage(text)
        });
    }
    let mut out = Vec::with_capacity(nranks);
    for _ in 0..nranks {
        rd(&mut s, &mut len4)?;
        let n = u32::from_le_bytes(len4) as usize;
        if n > MAX_BLOB {
            return Err(Error::Internal("bootstrap table entry too large".into()));
        }
        let mut b = vec![0u8; n];
        rd(&mut s, &mut b)?;
        out.push(b);
    }
    Ok(out)
}

/// An identity of this host: equal on two ranks iff they share a machine (hostname and
/// kernel boot id).
pub fn host_id() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |s: &str| {
        for b in s.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    };
    feed(&std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default());
    feed(&std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_round_trips() {
        let id = UniqueId::for_address("127.0.0.1:4000".parse().unwrap());
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
        assert_eq!(id.root().unwrap().0, "127.0.0.1:4000".parse().unwrap());
        let v6 = UniqueId::for_address("[::1]:5".parse().unwrap());
        assert_eq!(v6.root().unwrap().0.port(), 5);
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
        assert!(UniqueId::from_hex("zz").is_err());
    }

    #[test]
    fn rendezvous_exchanges_blobs() {
        let id = UniqueId::new().unwrap();
        let hs: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    rendezvous(&id, r, 3, &[r as u8; 5], Duration::from_secs(10))
                })
            })
            .collect();
        for h in hs {
            let t = h.join().unwrap().unwrap();
            assert_eq!(t, vec![vec![0u8; 5], vec![1u8; 5], vec![2u8; 5]]);
        }
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let id = UniqueId::for_address(addr);
        spawn_root(l, id.nonce());
        let t = Instant::now();
        let e = rendezvous(&id, 1, 4, b"x", Duration::from_millis(500))
            .unwrap_err()
            .to_string();
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "took {:?}",
            t.elapsed()
        );
        assert!(e.contains("ranks 0, 2, 3 never arrived"), "{e}");
    }

    #[test]
    fn a_duplicate_rank_fails_every_rank_naming_it() {
        let id = UniqueId::new().unwrap();
        // Rank 2 never comes; a second rank 1 does. Nobody waits for rank 2.
        let hs: Vec<_> = [0, 1, 1]
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    rendezvous(&id, r, 3, b"x", Duration::from_secs(20))
                        .map(|_| ())
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        for h in hs {
            let e = h.join().unwrap();
            assert!(e.contains("rank 1 joined twice"), "{e}");
        }
    }

    #[test]
    fn mismatched_nranks_is_refused() {
        let id = UniqueId::new().unwrap();
        let a = std::thread::spawn(move || rendezvous(&id, 0, 2, b"", Duration::from_secs(2)));
        std::thread::sleep(Duration::from_millis(100));
        let e = rendezvous(&id, 1, 3, b"", Duration::from_secs(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("same nranks"), "{e}");
        drop(a); // rank 0 waits for a rank that never comes; it times out on its own
    }
}
