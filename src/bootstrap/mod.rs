//! Bootstrap: unique ids, rendezvous through a root, launcher environments, interface choice.
//!
//! A [`UniqueId`] (128 bytes) holds the address of a *root*: a small TCP server that
//! collects one registration per rank — its rank, the communicator size and an opaque
//! blob (host identity, network listen handles) — and, once all `nranks` have arrived,
//! sends every rank the table of all blobs. If the timeout passes first, every waiting
//! rank gets an error that lists the ranks that never arrived.
//!
//! Ids: bytes `0..4` magic "RCID", `4` address family (4 or 6), `5` flags (bit 0: the id
//! carries a job secret), `6..8` port, `8..24` address, `24..32` nonce, `32..48` the job
//! secret (128 bits from the OS random source; zero without one), the rest zero.
//!
//! Wire format (all little endian). Registration: `magic u32 "RBS2"`, `nonce u64`,
//! `rank u32`, `nranks u32`, `blob_len u32`, `timeout_ms u32`, blob, then a 16-byte tag
//! (HMAC-SHA256 under a key derived from the id's secret, over everything before it; see
//! [`auth`]). The root drops a registration whose tag does not check (counted, logged once
//! per source) and answers it with an error, so that only ranks that know the secret can
//! join, set the timeout or fail the rendezvous. The root gives up `timeout_ms` (the smallest
//! any rank sent) after the first registration. Reply: `status u8` (0 ok, 1 error); ok:
//! `n × (len u32, bytes)`; error: `len u32`, UTF-8 message.
//!
//! The root never blocks on one connection: it reads every connection without blocking, and
//! drops one that has not sent a whole registration [`REG_DEADLINE`] after it connected (idle
//! port scanners, half-sent messages), or that sends garbage.

pub mod auth;
pub mod env;
pub mod ifaces;
pub mod seal;
pub mod spare;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const ID_MAGIC: u32 = 0x4449_4352; // "RCID"
const REG_MAGIC: u32 = 0x3253_4252; // "RBS2"
/// Magic of the registrations of roccl before the job secret: answered with an error naming
/// the version mismatch (the old rank prints it) rather than dropped.
const OLD_REG_MAGIC: u32 = 0x5453_4252; // "RBST"
/// Bytes of a registration before its blob.
const REG_HDR: usize = 28;
/// Flag of an id's byte 5: it carries a job secret.
const ID_HAS_SECRET: u8 = 1;
/// Flag of an id's byte 5: the job's bootstrap and TCP traffic are encrypted ([`seal`]).
const ID_ENCRYPTED: u8 = 2;
/// Magic of a registration of an encrypted job: its blob is sealed, and so is the reply.
const SEALED_REG_MAGIC: u32 = 0x3353_4252; // "RBS3"
/// Bytes of a job secret.
pub const SECRET_BYTES: usize = 16;
/// How long the root waits for a connection's whole registration (a rank sends it at once).
pub const REG_DEADLINE: Duration = Duration::from_secs(10);
/// Most connections the root reads at once; more are refused until some finish.
const MAX_PENDING: usize = 1024;
const MAX_BLOB: usize = 1 << 20;

/// Size of a unique id in bytes (as `NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;
/// Byte of a unique id with the number of its root's other addresses, which follow from 4
/// bytes further on, 4 bytes each (after the magic, the address, the nonce and the secret).
const OTHER_ROOTS: usize = 48;
/// Most other root addresses a unique id carries.
pub const MAX_OTHER_ROOTS: usize = 15;

/// Opaque id of a communicator being created: the root's address and a nonce. Create it on
/// one rank with [`UniqueId::new`] and pass its bytes to every rank out of band.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.root() {
            Ok((a, n)) => write!(
                f,
                "UniqueId(root {a}, nonce {n:016x}, {})",
                if self.has_secret() {
                    "with a job secret"
                } else {
                    "no job secret"
                }
            ),
            Err(_) => write!(f, "UniqueId(invalid)"),
        }
    }
}

impl UniqueId {
    /// Start a root in this process (a background thread that serves one communicator's
    /// rendezvous, then exits) on the interface chosen by `ROCCL_SOCKET_IFNAME`, and return
    /// its id.
    ///
    /// The job is encrypted when `ROCCL_ENCRYPT=1` (or [`seal::set`]) asks for it
    /// ([`UniqueId::new_with`]).
    pub fn new() -> Result<UniqueId> {
        UniqueId::new_with(seal::requested())
    }

    /// [`UniqueId::new`], saying whether the job's bootstrap and TCP traffic are encrypted
    /// (docs/SECURITY.md); every rank follows the id.
    pub fn new_with(encrypt: bool) -> Result<UniqueId> {
        let ip = ifaces::local_addr(None)?;
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::sys(format!("bind the bootstrap root on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname of the bootstrap root", e))?;
        let id = UniqueId::from_parts(
            addr,
            u64::from_le_bytes(auth::random()?),
            Some(auth::random()?),
            encrypt,
        );
        spawn_root(l, id);
        Ok(id)
    }

    /// A new id whose secret is the job secret the launcher gave every rank
    /// (`ROCCL_JOB_SECRET` / `_FILE`, salted by the root's address: [`env::job_secret`]), or
    /// none; for ids published where others may read them (torch's Store), through
    /// [`UniqueId::public`]. This process serves its root, as with [`UniqueId::new`].
    pub fn new_for_publishing(encrypt: bool) -> Result<UniqueId> {
        let ip = ifaces::local_addr(None)?;
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::sys(format!("bind the bootstrap root on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname of the bootstrap root", e))?;
        let secret = env::job_secret(addr)?;
        let id = UniqueId::from_parts(addr, u64::from_le_bytes(auth::random()?), secret, encrypt);
        spawn_root(l, id);
        Ok(id)
    }

    /// The id without its secret: what may be published where strangers can read it.
    pub fn public(&self) -> UniqueId {
        let mut b = self.bytes;
        b[5] &= !ID_HAS_SECRET;
        b[32..48].fill(0);
        UniqueId { bytes: b }
    }

    /// A [`UniqueId::public`] id completed with the job secret the launcher gave this rank
    /// (`ROCCL_JOB_SECRET` / `_FILE`), if any: every rank must be given the same.
    pub fn with_job_secret(&self) -> Result<UniqueId> {
        let (root, _) = self.root()?;
        let mut b = self.bytes;
        if let Some(k) = env::job_secret(root)? {
            b[5] |= ID_HAS_SECRET;
            b[32..48].copy_from_slice(&k);
        }
        Ok(UniqueId { bytes: b })
    }

    /// An id for a root at `addr` that some process serves with [`serve_root`] (environment
    /// launch: rank 0 serves the root at `ROCCL_ROOT` / `MASTER_ADDR`), without a job secret:
    /// the nonce is fixed, so every rank computes the same id from the address alone, and
    /// anyone who reaches the port can join. See [`UniqueId::for_address_with`].
    pub fn for_address(addr: SocketAddr) -> UniqueId {
        UniqueId::for_address_with(addr, None)
    }

    /// [`UniqueId::for_address`] with the job secret every rank was given
    /// (`ROCCL_JOB_SECRET`, [`env::job_secret`]): only processes that know it can join.
    /// Encrypted when this process asks for it ([`seal::requested`]); every rank must.
    pub fn for_address_with(addr: SocketAddr, secret: Option<[u8; SECRET_BYTES]>) -> UniqueId {
        UniqueId::from_parts(
            addr,
            0x726f_6363_6c00_0000 ^ addr.port() as u64,
            secret,
            seal::requested(),
        )
    }

    fn from_parts(
        addr: SocketAddr,
        nonce: u64,
        secret: Option<[u8; SECRET_BYTES]>,
        encrypt: bool,
    ) -> UniqueId {
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
        if let Some(k) = secret {
            b[5] = ID_HAS_SECRET;
            b[32..48].copy_from_slice(&k);
        }
        if encrypt {
            b[5] |= ID_ENCRYPTED;
        }
        UniqueId { bytes: b }
    }

    /// Whether the id carries a job secret (ids of [`UniqueId::new`] always do; address ids
    /// only with `ROCCL_JOB_SECRET`).
    pub fn has_secret(&self) -> bool {
        self.bytes[5] & ID_HAS_SECRET != 0
    }

    /// Whether the job's bootstrap and TCP traffic are encrypted (`ROCCL_ENCRYPT` where the
    /// id was made; docs/SECURITY.md).
    pub fn encrypted(&self) -> bool {
        self.bytes[5] & ID_ENCRYPTED != 0
    }

    /// The key every registration and connection of this id's communicator is authenticated
    /// with: derived from the secret (all zero without one), the root address, the nonce and
    /// the flags, and from the pre-shared key of [`seal::set`] where one was given.
    pub fn job_key(&self) -> auth::JobKey {
        seal::mix_psk(
            auth::JobKey::from_secret(&self.bytes[32..48], &self.bytes[0..32]),
            &self.bytes[0..32],
        )
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
        if b[5] & !(ID_HAS_SECRET | ID_ENCRYPTED) != 0 {
            return Err(Error::arg(format!(
                "unique id has unknown flags {:#04x} (from a newer roccl?)",
                b[5]
            )));
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
        let others = self.other_roots();
        if others.is_empty() {
            return Ok((SocketAddr::new(ip, port), self.nonce()));
        }
        // Several addresses (a root on a switchless mesh): the one this host reaches.
        Ok((
            SocketAddr::new(ifaces::reach(ip, &others), port),
            self.nonce(),
        ))
    }

    /// The same id, naming `others` too as addresses of its root (IPv4, at most
    /// [`MAX_OTHER_ROOTS`]): [`UniqueId::root`] returns the one this host reaches. They are
    /// not part of the job key, so ranks given them in another order still agree.
    pub fn with_other_roots(mut self, others: &[Ipv4Addr]) -> Result<UniqueId> {
        if others.len() > MAX_OTHER_ROOTS {
            return Err(Error::arg(format!(
                "{} root addresses: at most {} fit in a unique id",
                others.len() + 1,
                MAX_OTHER_ROOTS + 1
            )));
        }
        if !others.is_empty() && self.bytes[4] != 4 {
            return Err(Error::arg(
                "a root of several addresses takes IPv4 addresses only",
            ));
        }
        ifaces::put_others(
            &mut self.bytes,
            OTHER_ROOTS,
            OTHER_ROOTS + 4,
            others,
            MAX_OTHER_ROOTS,
        );
        Ok(self)
    }

    /// The root's other addresses ([`UniqueId::with_other_roots`]).
    pub fn other_roots(&self) -> Vec<Ipv4Addr> {
        ifaces::get_others(&self.bytes, OTHER_ROOTS, OTHER_ROOTS + 4, MAX_OTHER_ROOTS)
            .unwrap_or_default()
    }

    fn nonce(&self) -> u64 {
        u64::from_le_bytes(self.bytes[24..32].try_into().unwrap())
    }
}

/// Serve the root of one communicator on `addr` in a background thread (environment
/// launch: rank 0 calls this with the agreed address before joining).
/// The id has no job secret (see [`serve_root_with`]).
pub fn serve_root(addr: SocketAddr) -> Result<UniqueId> {
    serve_root_with(addr, None)
}

/// [`serve_root`] for a job with the secret `secret` (`ROCCL_JOB_SECRET`): the root admits
/// only registrations made with it.
pub fn serve_root_with(addr: SocketAddr, secret: Option<[u8; SECRET_BYTES]>) -> Result<UniqueId> {
    serve_root_on(addr, &[], secret)
}

/// [`serve_root_with`] for a root that ranks reach at `addr` or at one of `others` (a
/// switchless mesh: the root's address on each cable, `ROCCL_ROOT=a,b,c:port`): it listens
/// on every address, and the id names them all ([`UniqueId::with_other_roots`]).
pub fn serve_root_on(
    addr: SocketAddr,
    others: &[Ipv4Addr],
    secret: Option<[u8; SECRET_BYTES]>,
) -> Result<UniqueId> {
    let bind = if others.is_empty() {
        addr
    } else {
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port())
    };
    let l = bind_retry(bind, Duration::from_secs(5))?;
    // Port 0 (a single rank with no agreed port) binds any free port: publish that one.
    let port = l.local_addr().map(|a| a.port()).unwrap_or(addr.port());
    let id = UniqueId::for_address_with(SocketAddr::new(addr.ip(), port), secret)
        .with_other_roots(others)?;
    spawn_root(l, id);
    Ok(id)
}

/// The error of a job asked to encrypt that has no secret: its keys would come from the
/// root's address and port alone, which anyone can compute.
pub fn keyless_encryption(rank: usize) -> Error {
    Error::InvalidUsage(format!(
        "rank {rank}: ROCCL_ENCRYPT=1 (or ncclSetEncryption without a key) but the job has no secret: its keys would derive from the root's address and port, which anyone can compute, so nothing would be hidden. Give every rank the same ROCCL_JOB_SECRET (e.g. export ROCCL_JOB_SECRET=$(openssl rand -hex 16) before launching) or ROCCL_JOB_SECRET_FILE, or a pre-shared key through ncclSetEncryption, or use a unique id from rocclGetUniqueId (it carries a secret)"
    ))
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
    /// Its registration's tag (an encrypted job's reply is bound to it).
    tag: [u8; auth::TAG_BYTES],
}

fn spawn_root(l: TcpListener, id: UniqueId) {
    std::thread::Builder::new()
        .name("roccl-root".into())
        .spawn(move || run_root(l, id))
        .expect("spawning the bootstrap root thread");
}

#[derive(Debug)]
struct Reg {
    rank: usize,
    nranks: usize,
    /// As sent: sealed when `sealed` ([`open_blob`]).
    blob: Vec<u8>,
    timeout: Duration,
    /// The registration is of an encrypted job (its blob sealed, [`SEALED_REG_MAGIC`]).
    sealed: bool,
    /// Its tag: the reply of an encrypted job is bound to it.
    tag: [u8; auth::TAG_BYTES],
}

/// The key blobs of an encrypted job's registrations are sealed with.
fn blob_key(id: &UniqueId) -> seal::SealKey {
    seal::SealKey::new(&id.job_key().derive(b"registration blob seal"))
}

/// The key an encrypted job's reply tables are sealed with (each bound to its registration).
fn table_key(id: &UniqueId) -> seal::SealKey {
    seal::SealKey::new(&id.job_key().derive(b"reply table seal"))
}

/// The key of registrations with the root of `id`.
fn reg_key(id: &UniqueId) -> auth::JobKey {
    id.job_key().derive(b"registration")
}

/// A registration: header, blob, tag.
fn encode_reg(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    blob: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    let sealed;
    let (magic, blob) = if id.encrypted() {
        sealed = blob_key(id).seal_random(&[], blob)?;
        (SEALED_REG_MAGIC, &sealed[..])
    } else {
        (REG_MAGIC, blob)
    };
    let mut msg = Vec::with_capacity(REG_HDR + blob.len() + auth::TAG_BYTES);
    msg.extend_from_slice(&magic.to_le_bytes());
    msg.extend_from_slice(&id.nonce().to_le_bytes());
    msg.extend_from_slice(&(rank as u32).to_le_bytes());
    msg.extend_from_slice(&(nranks as u32).to_le_bytes());
    msg.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    msg.extend_from_slice(&(timeout.as_millis().min(u32::MAX as u128) as u32).to_le_bytes());
    msg.extend_from_slice(blob);
    let tag = reg_key(id).tag(&[&msg]);
    msg.extend_from_slice(&tag);
    Ok(msg)
}

/// What the bytes a connection sent so far are.
#[derive(Debug)]
enum Parsed {
    /// A registration needs this many bytes in all; not all have arrived.
    Need(usize),
    /// A whole registration whose tag checks.
    Reg(Reg),
    /// Not a registration of this root's job: why, and whether to answer (a roccl rank
    /// with another id or secret gets told; garbage does not).
    Refused(String, bool),
}

/// The root's parser, without I/O: `b` is everything a connection sent so far.
fn parse_reg(b: &[u8], nonce: u64, key: &auth::JobKey) -> Parsed {
    if b.len() >= 4 && u32::from_le_bytes(b[0..4].try_into().unwrap()) == OLD_REG_MAGIC {
        return Parsed::Refused(
            "a registration of an older roccl (without the job secret): every rank must run the same roccl version".into(),
            true,
        );
    }
    if b.len() < REG_HDR {
        // Garbage is refused as soon as its first bytes show it.
        if b.len() >= 4
            && ![REG_MAGIC, SEALED_REG_MAGIC]
                .contains(&u32::from_le_bytes(b[0..4].try_into().unwrap()))
        {
            return Parsed::Refused("not a roccl registration (bad magic)".into(), false);
        }
        return Parsed::Need(REG_HDR);
    }
    let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    if u32at(0) != REG_MAGIC && u32at(0) != SEALED_REG_MAGIC {
        return Parsed::Refused("not a roccl registration (bad magic)".into(), false);
    }
    let len = u32at(20) as usize;
    if len > MAX_BLOB {
        return Parsed::Refused(
            format!("registration blob of {len} bytes is too large"),
            false,
        );
    }
    let total = REG_HDR + len + auth::TAG_BYTES;
    if b.len() < total {
        return Parsed::Need(total);
    }
    if u64::from_le_bytes(b[4..12].try_into().unwrap()) != nonce {
        return Parsed::Refused(
            "the registration is for another communicator (its unique id differs: a rank of another job, or of an earlier run on the same port?)".into(),
            true,
        );
    }
    if !key.verify(
        &[&b[..total - auth::TAG_BYTES]],
        &b[total - auth::TAG_BYTES..total],
    ) {
        return Parsed::Refused(
            "the registration is not authenticated by this job's secret (every rank must be given the same unique id, or in launcher mode the same ROCCL_JOB_SECRET / ROCCL_JOB_SECRET_FILE and ROCCL_ENCRYPT; with ncclSetEncryption, the same pre-shared key)".into(),
            true,
        );
    }
    Parsed::Reg(Reg {
        rank: u32at(12) as usize,
        nranks: u32at(16) as usize,
        blob: b[REG_HDR..REG_HDR + len].to_vec(),
        timeout: Duration::from_millis(u32at(24) as u64),
        sealed: u32at(0) == SEALED_REG_MAGIC,
        tag: b[total - auth::TAG_BYTES..total].try_into().unwrap(),
    })
}

/// The blob of an authenticated registration, opened where the job is encrypted; `Err` with
/// why it is refused (it does not encrypt as the job does, or its blob does not open).
fn open_blob(id: &UniqueId, reg: &Reg) -> std::result::Result<Vec<u8>, String> {
    match (reg.sealed, id.encrypted()) {
        (false, false) => Ok(reg.blob.clone()),
        (true, true) => blob_key(id)
            .open_random(&[], &reg.blob)
            .ok_or_else(|| "its sealed blob does not open with this job's key".to_string()),
        (sealed, _) => Err(format!(
            "rank {} {} but this job {} (ROCCL_ENCRYPT, or ncclSetEncryption, must be the same on every rank)",
            reg.rank,
            if sealed { "encrypts" } else { "does not encrypt" },
            if sealed { "does not" } else { "does" },
        )),
    }
}

/// Whether a refused registration starts with the magic of the other encryption setting
/// than `id`'s (so the refusal can say so).
fn other_encryption(b: &[u8], id: &UniqueId) -> bool {
    let other = if id.encrypted() {
        REG_MAGIC
    } else {
        SEALED_REG_MAGIC
    };
    b.len() >= 4 && u32::from_le_bytes(b[0..4].try_into().unwrap()) == other
}

/// Checks of the root's registration parser without I/O, for the fuzz targets. `sign`:
/// first make `b` a registration of this job as far as its bytes go (the nonce of the key's
/// id, a good tag), so that what follows the authentication is reached too.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_registration(b: &[u8], sign: bool) {
    let id = UniqueId::for_address_with(
        SocketAddr::from(([127, 0, 0, 1], 1)),
        Some([7; SECRET_BYTES]),
    );
    let key = reg_key(&id);
    let nonce = id.nonce();
    let mut b = b.to_vec();
    if sign && b.len() >= REG_HDR {
        b[4..12].copy_from_slice(&nonce.to_le_bytes());
        let len = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
        let total = REG_HDR.saturating_add(len).saturating_add(auth::TAG_BYTES);
        if b.len() >= total {
            let tag = key.tag(&[&b[..total - auth::TAG_BYTES]]);
            b[total - auth::TAG_BYTES..total].copy_from_slice(&tag);
        }
    }
    match parse_reg(&b, nonce, &key) {
        Parsed::Need(n) => assert!(n > b.len(), "needs {n} of {} bytes", b.len()),
        Parsed::Reg(r) => {
            assert!(r.blob.len() <= MAX_BLOB);
            // A sealed blob of random bytes must be refused, not a panic.
            let _ = open_blob(&id, &r);
        }
        Parsed::Refused(..) => {}
    }
}

/// A registration of `blob` as rank `rank` of `nranks` for the fuzz targets' job (the one
/// [`fuzz_registration`] signs for): a seed of its corpus.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seed_registration(rank: usize, nranks: usize, blob: &[u8]) -> Vec<u8> {
    let id = UniqueId::for_address_with(
        SocketAddr::from(([127, 0, 0, 1], 1)),
        Some([7; SECRET_BYTES]),
    );
    encode_reg(&id, rank, nranks, blob, Duration::from_secs(30)).unwrap_or_default()
}

/// A connection to the root whose registration has not all arrived.
struct Incoming {
    stream: TcpStream,
    from: SocketAddr,
    got: Vec<u8>,
    deadline: Instant,
}

/// Read what `c` has sent, up to `want` bytes in all, without blocking; `Err` when the
/// connection is closed or failed.
fn read_some(c: &mut Incoming, want: usize) -> std::io::Result<()> {
    let mut buf = [0u8; 16 * 1024];
    while c.got.len() < want {
        let n = (want - c.got.len()).min(buf.len());
        match c.stream.read(&mut buf[..n]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => c.got.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn send_error(s: &mut TcpStream, msg: &str) {
    let mut out = vec![1u8];
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg.as_bytes());
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
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

fn run_root(l: TcpListener, id: UniqueId) {
    let nonce = id.nonce();
    let key = reg_key(&id);
    let mut start = Instant::now();
    let mut timeout = ROOT_IDLE;
    let mut first = true;
    let mut last_said = Instant::now();
    let at = l
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let _ = l.set_nonblocking(true);
    let mut joined: BTreeMap<usize, Joined> = BTreeMap::new();
    let mut incoming: Vec<Incoming> = Vec::new();
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
            // Highest rank first, as in `fail_all`: rank 0's process, which usually hosts
            // this thread, exits as soon as it reads the error.
            for j in joined.values_mut().rev() {
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
        let mut progressed = false;
        loop {
            match l.accept() {
                Ok((s, from)) => {
                    progressed = true;
                    if incoming.len() >= MAX_PENDING {
                        auth::refuse(
                            "bootstrap root",
                            Some(from.ip()),
                            "too many connections at once",
                        );
                        continue;
                    }
                    let _ = s.set_nonblocking(true);
                    let _ = s.set_nodelay(true);
                    incoming.push(Incoming {
                        stream: s,
                        from,
                        got: Vec::new(),
                        deadline: Instant::now() + REG_DEADLINE,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
        let mut i = 0;
        while i < incoming.len() {
            let c = &mut incoming[i];
            let before = c.got.len();
            let mut parsed = parse_reg(&c.got, nonce, &key);
            while let Parsed::Need(want) = parsed {
                if let Err(e) = read_some(c, want) {
                    parsed = Parsed::Refused(
                        format!("the connection closed before a whole registration ({e})"),
                        false,
                    );
                    break;
                }
                if c.got.len() < want {
                    break;
                }
                parsed = parse_reg(&c.got, nonce, &key);
            }
            progressed |= c.got.len() != before;
            let reg = match parsed {
                Parsed::Need(_) if Instant::now() < c.deadline => {
                    i += 1;
                    continue;
                }
                Parsed::Need(_) => {
                    let c = incoming.swap_remove(i);
                    auth::refuse(
                        "bootstrap root",
                        Some(c.from.ip()),
                        &format!(
                            "no whole registration within {REG_DEADLINE:.0?} ({} bytes)",
                            c.got.len()
                        ),
                    );
                    continue;
                }
                Parsed::Refused(mut why, answer) => {
                    let mut c = incoming.swap_remove(i);
                    if answer && other_encryption(&c.got, &id) {
                        why = format!(
                            "a registration {} encryption, but this job {} (ROCCL_ENCRYPT, or ncclSetEncryption, must be the same on every rank)",
                            if id.encrypted() { "without" } else { "with" },
                            if id.encrypted() { "encrypts" } else { "does not" },
                        );
                    }
                    auth::refuse("bootstrap root", Some(c.from.ip()), &why);
                    if answer {
                        send_error(&mut c.stream, &format!("bootstrap root at {at}: {why}"));
                    }
                    continue;
                }
                Parsed::Reg(r) => r,
            };
            let Incoming {
                stream: mut s,
                from,
                ..
            } = incoming.swap_remove(i);
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
            let blob = match open_blob(&id, &reg) {
                Ok(b) => b,
                Err(why) => {
                    auth::refuse("bootstrap root", Some(from.ip()), &why);
                    send_error(&mut s, &format!("bootstrap root at {at}: {why}"));
                    continue;
                }
            };
            let Reg {
                rank,
                nranks: n,
                timeout: t,
                tag,
                ..
            } = reg;
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
                    tag,
                },
            );
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mut table = Vec::new();
    for j in joined.values() {
        table.extend_from_slice(&(j.blob.len() as u32).to_le_bytes());
        table.extend_from_slice(&j.blob);
    }
    // An encrypted job's reply: status 0, the sealed table's length, the table sealed for
    // each rank and bound to its registration (a reply cannot be replayed to another).
    let tkey = id.encrypted().then(|| table_key(&id));
    for j in joined.values_mut() {
        let reply = match &tkey {
            None => [&[0u8][..], &table].concat(),
            Some(k) => match k.seal_random(&j.tag, &table) {
                Ok(sealed) => [&[0u8][..], &(sealed.len() as u32).to_le_bytes(), &sealed].concat(),
                Err(e) => {
                    send_error(&mut j.stream, &format!("bootstrap root: {e}"));
                    continue;
                }
            },
        };
        let _ = j.stream.write_all(&reply);
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
    let (addr, _) = id.root()?;
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
    let msg = encode_reg(id, rank, nranks, blob, timeout)?;
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
    if id.encrypted() {
        rd(&mut s, &mut len4)?;
        let n = u32::from_le_bytes(len4) as usize;
        if n > nranks.saturating_mul(4 + MAX_BLOB) + seal::SEAL_OVERHEAD {
            return Err(Error::Internal(format!(
                "the bootstrap root at {addr} announced a reply of {n} bytes, more than {nranks} ranks' blobs"
            )));
        }
        // Grown as the bytes arrive (a megabyte at a time): a root that announces more than
        // it sends makes this rank wait out its timeout, not allocate what it announced.
        let mut sealed = Vec::new();
        while sealed.len() < n {
            let at = sealed.len();
            sealed.resize(at + (n - at).min(1 << 20), 0);
            rd(&mut s, &mut sealed[at..])?;
        }
        let tag = &msg[msg.len() - auth::TAG_BYTES..];
        let table = table_key(id).open_random(tag, &sealed).ok_or_else(|| {
            Error::InvalidUsage(format!(
                "rank {rank}: the reply of the bootstrap root at {addr} does not open with this job's key (a stranger answering on the root's port?)"
            ))
        })?;
        return parse_table(&table, nranks).ok_or_else(|| {
            Error::Internal(format!(
                "rank {rank}: the bootstrap root's reply does not hold {nranks} blobs"
            ))
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

/// The `nranks` blobs of a reply table (each a u32 LE length and its bytes, nothing after);
/// `None` when it is not one.
fn parse_table(mut t: &[u8], nranks: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(nranks);
    for _ in 0..nranks {
        let n = u32::from_le_bytes(t.get(..4)?.try_into().ok()?) as usize;
        out.push(t.get(4..4 + n)?.to_vec());
        t = &t[4 + n..];
    }
    t.is_empty().then_some(out)
}

/// An identity of this host: equal on two ranks iff they share a machine (hostname and
/// kernel boot id).
pub fn host_id() -> u64 {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    host_id_of(&(name + &boot))
}

/// The host identity of a host named `name` (`ROCCL_HOSTID`; [`host_id`] names the machine
/// by its hostname and boot id): FNV-1a of the name.
pub fn host_id_of(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
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
    fn an_id_names_its_roots_other_addresses_outside_the_job_key() {
        let at: SocketAddr = "10.81.1.1:4000".parse().unwrap();
        let others: Vec<Ipv4Addr> =
            vec!["10.81.2.1".parse().unwrap(), "127.0.0.1".parse().unwrap()];
        let plain = UniqueId::for_address(at);
        let id = plain.with_other_roots(&others).unwrap();
        assert_eq!(id.other_roots(), others);
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
        // The same job whatever addresses each rank was given.
        assert_eq!(id.job_key(), plain.job_key());
        // This host reaches loopback: that one is the root here.
        assert_eq!(id.root().unwrap().0, "127.0.0.1:4000".parse().unwrap());
        assert!(plain.other_roots().is_empty());
        let many = vec![Ipv4Addr::LOCALHOST; MAX_OTHER_ROOTS + 1];
        let e = plain.with_other_roots(&many).unwrap_err().to_string();
        assert!(e.contains("at most 16"), "{e}");
        let v6 = UniqueId::for_address("[::1]:5".parse().unwrap());
        assert!(v6.with_other_roots(&others).is_err());
    }

    #[test]
    fn ids_carry_a_secret_from_the_os() {
        let a = UniqueId::new().unwrap();
        let b = UniqueId::new().unwrap();
        assert!(a.has_secret() && b.has_secret());
        assert_ne!(a.as_bytes()[32..48], b.as_bytes()[32..48]);
        assert_ne!(a.job_key(), b.job_key());
        assert_eq!(UniqueId::from_bytes(a.as_bytes()).unwrap(), a);
        assert!(format!("{a:?}").contains("with a job secret"));
        let at: SocketAddr = "10.0.0.1:29500".parse().unwrap();
        let open = UniqueId::for_address(at);
        assert!(!open.has_secret());
        let s1 = UniqueId::for_address_with(at, Some([1; SECRET_BYTES]));
        let s2 = UniqueId::for_address_with(at, Some([2; SECRET_BYTES]));
        assert_eq!(s1.root().unwrap(), open.root().unwrap());
        assert_ne!(s1.job_key(), open.job_key());
        assert_ne!(s1.job_key(), s2.job_key());
        let mut bad = *s1.as_bytes();
        bad[5] = 0x80;
        assert!(UniqueId::from_bytes(&bad).is_err());
    }

    #[test]
    fn the_parser_takes_only_registrations_of_this_job() {
        let id = UniqueId::new().unwrap();
        let (key, nonce) = (reg_key(&id), id.nonce());
        let reg = encode_reg(&id, 1, 3, b"blob", Duration::from_secs(2)).unwrap();
        match parse_reg(&reg, nonce, &key) {
            Parsed::Reg(r) => {
                assert_eq!((r.rank, r.nranks, r.blob.as_slice()), (1, 3, &b"blob"[..]));
                assert_eq!(r.timeout, Duration::from_secs(2));
            }
            p => panic!("{p:?}"),
        }
        for k in 0..reg.len() {
            assert!(
                matches!(parse_reg(&reg[..k], nonce, &key), Parsed::Need(_)),
                "{k}"
            );
        }
        for i in 0..reg.len() {
            let mut b = reg.clone();
            b[i] ^= 1;
            assert!(!matches!(parse_reg(&b, nonce, &key), Parsed::Reg(_)), "{i}");
        }
        // Same root and nonce, another secret: refused, and told why.
        let other =
            UniqueId::from_parts(id.root().unwrap().0, nonce, Some([7; SECRET_BYTES]), false);
        let forged = encode_reg(&other, 1, 3, b"blob", Duration::from_secs(2)).unwrap();
        match parse_reg(&forged, nonce, &key) {
            Parsed::Refused(why, true) => assert!(why.contains("not authenticated"), "{why}"),
            p => panic!("{p:?}"),
        }
        assert!(matches!(
            parse_reg(b"GET / HTTP/1.1", nonce, &key),
            Parsed::Refused(_, false)
        ));
        match parse_reg(b"RBST", nonce, &key) {
            Parsed::Refused(why, true) => assert!(why.contains("older roccl"), "{why}"),
            p => panic!("{p:?}"),
        }
        let mut huge = reg[..REG_HDR].to_vec();
        huge[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse_reg(&huge, nonce, &key),
            Parsed::Refused(_, false)
        ));
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
    fn an_encrypted_rendezvous_seals_blobs_and_refuses_ranks_that_do_not_encrypt() {
        let id = UniqueId::new_with(true).unwrap();
        assert!(id.encrypted() && id.has_secret());
        assert!(!UniqueId::new_with(false).unwrap().encrypted());
        assert_eq!(UniqueId::from_bytes(id.as_bytes()).unwrap(), id);
        // The registration's blob is sealed: the marker is not on the wire.
        let marker = b"a listener's address and token";
        let reg = encode_reg(&id, 1, 3, marker, Duration::from_secs(2)).unwrap();
        assert!(!reg.windows(marker.len()).any(|w| w == marker));
        match parse_reg(&reg, id.nonce(), &reg_key(&id)) {
            Parsed::Reg(r) => {
                assert!(r.sealed);
                assert_eq!(open_blob(&id, &r).unwrap(), marker);
            }
            p => panic!("{p:?}"),
        }
        // A rank given the same id without the encryption flag is refused, told why.
        let mut plain = *id.as_bytes();
        plain[5] &= !ID_ENCRYPTED;
        let plain = UniqueId::from_bytes(&plain).unwrap();
        let hs: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    rendezvous(&id, r, 3, &[r as u8; 5], Duration::from_secs(3))
                })
            })
            .collect();
        let e = rendezvous(&plain, 2, 3, &[2; 5], Duration::from_secs(3))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("without encryption") && e.contains("ROCCL_ENCRYPT"),
            "{e}"
        );
        for h in hs {
            assert!(h.join().unwrap().is_err(), "rank 2 never joined");
        }
        // An encrypted job whose ranks agree completes, each reply sealed for its rank.
        let id = UniqueId::new_with(true).unwrap();
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
        assert_eq!(
            parse_table(&[1, 0, 0, 0, 9, 0, 0, 0, 0], 2),
            Some(vec![vec![9], vec![]])
        );
        assert_eq!(parse_table(&[1, 0, 0, 0, 9, 0, 0, 0, 0, 7], 2), None);
        assert_eq!(parse_table(&[5, 0, 0, 0, 9], 1), None);
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let id = UniqueId::for_address(addr);
        spawn_root(l, id);
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
