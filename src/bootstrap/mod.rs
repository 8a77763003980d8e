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
//! The root's wire format (a challenge per connection, registrations tagged over it, replies
//! tagged over the registration) is in `wire`; the root's loop in `root`. A rank tries
//! again when its connection fails or closes before the reply, until its timeout; it takes
//! only a reply authenticated by the job's key.

pub mod auth;
pub mod env;
pub mod ifaces;
mod root;
pub mod seal;
pub mod spare;
mod wire;

use root::spawn_root;
#[cfg(feature = "fuzzing")]
pub(crate) use wire::{fuzz_registration, fuzz_seed_registration};

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const ID_MAGIC: u32 = 0x4449_4352; // "RCID"
/// Flag of an id's byte 5: it carries a job secret.
const ID_HAS_SECRET: u8 = 1;
/// Flag of an id's byte 5: the job's bootstrap and TCP traffic are encrypted ([`seal`]).
const ID_ENCRYPTED: u8 = 2;
/// Bytes of a job secret.
pub const SECRET_BYTES: usize = 16;
/// How long the root waits for a connection's whole registration (a rank sends it at once).
pub const REG_DEADLINE: Duration = Duration::from_secs(10);

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
        UniqueId::new_served(encrypt, |_| Ok(Some(auth::random()?)))
    }

    /// A new id whose secret is the job secret the launcher gave every rank
    /// (`ROCCL_JOB_SECRET` / `_FILE`, salted by the root's address: [`env::job_secret`]), or
    /// none; for ids published where others may read them (torch's Store), through
    /// [`UniqueId::public`]. This process serves its root, as with [`UniqueId::new`].
    pub fn new_for_publishing(encrypt: bool) -> Result<UniqueId> {
        UniqueId::new_served(encrypt, env::job_secret)
    }

    /// A root bound on this host's address and served by this process, with a random nonce
    /// and the secret `secret` gives for the root's address.
    fn new_served(
        encrypt: bool,
        secret: impl FnOnce(SocketAddr) -> Result<Option<[u8; SECRET_BYTES]>>,
    ) -> Result<UniqueId> {
        let ip = ifaces::local_addr(None)?;
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::sys(format!("bind the bootstrap root on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname of the bootstrap root", e))?;
        let nonce = u64::from_le_bytes(auth::random()?);
        let id = UniqueId::from_parts(addr, nonce, secret(addr)?, encrypt);
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

/// How often a bootstrap that is still waiting says so: every 5 s, or four times within a
/// shorter timeout.
pub fn progress_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(5))
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

/// How long one try to connect to the root may take (a rank tries again until its deadline).
const ROOT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// [`rendezvous`], ended within about 100 ms by `abort` (set from another thread,
/// e.g. by `rocclCommAbort` during a non-blocking init) with an error saying so.
///
/// A connection that fails or closes before the root answers (the root is not up yet, or
/// dropped this connection among strangers) is tried again until `timeout`; a reply that is
/// not authenticated by this job's key is never taken.
pub fn rendezvous_abortable(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    blob: &[u8],
    timeout: Duration,
    abort: &std::sync::atomic::AtomicBool,
) -> Result<Vec<Vec<u8>>> {
    if nranks == 0 {
        return Err(Error::arg("nranks must be at least 1"));
    }
    if rank >= nranks {
        return Err(Error::arg(format!(
            "rank {rank} is out of range: nranks is {nranks}"
        )));
    }
    let (addr, _) = id.root()?;
    let join = Join {
        id,
        rank,
        nranks,
        blob,
        timeout,
        addr,
        abort,
        start: Instant::now(),
    };
    let mut last_said = join.start;
    loop {
        let why = match join.attempt() {
            Ok(table) => return Ok(table),
            Err(Attempt::Fail(e)) => return Err(e),
            Err(Attempt::Retry(why)) => why,
        };
        if join.start.elapsed() > timeout {
            return Err(Error::timeout(Vec::new(), format!(
                "rank {rank} could not register with the bootstrap root at {addr} within {timeout:.0?}: {why} (is rank 0 / the process that created the id running, and is {addr} reachable from here?)"
            )));
        }
        if last_said.elapsed() >= progress_interval(timeout) {
            last_said = Instant::now();
            crate::warn!(
                "rank {rank}: after {:.0?}, still waiting for the bootstrap root at {addr} ({why}); gives up after {timeout:.0?} (ROCCL_TIMEOUT)",
                join.start.elapsed()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How one try to register ended without the table.
enum Attempt {
    /// Try again (until the deadline): why this one did not get through.
    Retry(String),
    /// The answer is final.
    Fail(Error),
}

/// One rank's registration with the root.
struct Join<'a> {
    id: &'a UniqueId,
    rank: usize,
    nranks: usize,
    blob: &'a [u8],
    timeout: Duration,
    addr: SocketAddr,
    abort: &'a std::sync::atomic::AtomicBool,
    start: Instant,
}

impl Join<'_> {
    /// Connect, answer the root's challenge and read its reply.
    fn attempt(&self) -> std::result::Result<Vec<Vec<u8>>, Attempt> {
        use Attempt::Retry;
        if self.abort.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Attempt::Fail(self.aborted()));
        }
        let mut s = TcpStream::connect_timeout(&self.addr, ROOT_CONNECT_TIMEOUT)
            .map_err(|e| Retry(e.to_string()))?;
        let _ = s.set_nodelay(true);
        // Short read timeouts: the abort flag is looked at between them.
        let _ = s.set_read_timeout(Some(ABORT_POLL));
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        self.read(&mut s, &mut c, "its challenge")?;
        let challenge = wire::parse_challenge(&c).ok_or_else(|| {
            Retry(format!(
                "what answers at {} is not a roccl bootstrap root",
                self.addr
            ))
        })?;
        let msg = wire::encode_reg(
            self.id,
            &challenge,
            self.rank,
            self.nranks,
            self.blob,
            self.timeout,
        )
        .map_err(Attempt::Fail)?;
        s.write_all(&msg)
            .map_err(|e| Retry(format!("sending the registration failed ({e})")))?;
        let reg_tag = &msg[msg.len() - auth::TAG_BYTES..];
        let mut head = [0u8; 5];
        self.read(&mut s, &mut head, "its reply")?;
        let n = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
        let most = if head[0] == wire::STATUS_TABLE {
            self.nranks.saturating_mul(4 + wire::MAX_BLOB) + seal::SEAL_OVERHEAD
        } else {
            wire::MAX_ERROR
        };
        if n > most {
            return Err(Attempt::Fail(
                self.unauthentic(&format!("a reply of {n} bytes")),
            ));
        }
        // Grown as the bytes arrive (a megabyte at a time): a root that announces more than
        // it sends makes this rank wait out its timeout, not allocate what it announced.
        let mut payload = Vec::new();
        while payload.len() < n {
            let at = payload.len();
            payload.resize(at + (n - at).min(1 << 20), 0);
            self.read(&mut s, &mut payload[at..], "its reply")?;
        }
        let mut tag = [0u8; auth::TAG_BYTES];
        self.read(&mut s, &mut tag, "its reply")?;
        let key = wire::reply_key(self.id);
        let authentic = wire::reply_authentic(&key, reg_tag, &head, &payload, &tag);
        self.answer(head[0], payload, authentic, reg_tag)
    }

    /// What the root's reply means.
    fn answer(
        &self,
        status: u8,
        payload: Vec<u8>,
        authentic: bool,
        reg_tag: &[u8],
    ) -> std::result::Result<Vec<Vec<u8>>, Attempt> {
        let (rank, addr) = (self.rank, self.addr);
        if status != wire::STATUS_TABLE {
            let text = String::from_utf8_lossy(&payload).into_owned();
            return Err(Attempt::Fail(match (authentic, status) {
                (false, _) => self.unauthentic(&format!("a refusal saying \"{text}\"")),
                (true, wire::STATUS_TIMEOUT) => Error::timeout(Vec::new(), text),
                (true, _) => Error::InvalidUsage(text),
            }));
        }
        if !authentic {
            return Err(Attempt::Fail(self.unauthentic("a table")));
        }
        let table = if self.id.encrypted() {
            wire::table_key(self.id)
                .open_random(reg_tag, &payload)
                .ok_or_else(|| {
                    Attempt::Fail(self.unauthentic("a sealed table that does not open"))
                })?
        } else {
            payload
        };
        wire::parse_table(&table, self.nranks).ok_or_else(|| {
            Attempt::Fail(Error::Internal(format!(
                "rank {rank}: the reply of the bootstrap root at {addr} does not hold {} blobs",
                self.nranks
            )))
        })
    }

    /// Fill `b` from `s`; a close or failure is worth another try, the deadline is not.
    fn read(
        &self,
        s: &mut TcpStream,
        b: &mut [u8],
        what: &str,
    ) -> std::result::Result<(), Attempt> {
        let until = self.start + self.timeout + Duration::from_secs(5);
        let mut got = 0;
        while got < b.len() {
            match s.read(&mut b[got..]) {
                Ok(0) => {
                    return Err(Attempt::Retry(format!(
                        "the root closed the connection before {what}"
                    )))
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
                    if self.abort.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(Attempt::Fail(self.aborted()));
                    }
                    if Instant::now() > until {
                        return Err(Attempt::Fail(Error::timeout(
                            Vec::new(),
                            format!(
                                "rank {} waited {:.0?} for the bootstrap root at {} to send {what}",
                                self.rank,
                                self.timeout + Duration::from_secs(5),
                                self.addr
                            ),
                        )));
                    }
                }
                Err(e) => return Err(Attempt::Retry(format!("reading {what} failed ({e})"))),
            }
        }
        Ok(())
    }

    fn aborted(&self) -> Error {
        Error::InvalidUsage(format!(
            "rank {}: initialization was aborted by the application while waiting for the bootstrap root",
            self.rank
        ))
    }

    /// A reply this rank does not take: it is not authenticated by the job's key.
    fn unauthentic(&self, what: &str) -> Error {
        Error::InvalidUsage(format!(
            "rank {}: the bootstrap root at {} answered with {what}, not authenticated by this job's key: the root has another id or secret (every rank must be given the same unique id, or the same ROCCL_JOB_SECRET and ROCCL_ENCRYPT), or a stranger answers on the root's port",
            self.rank, self.addr
        ))
    }
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
        let c = [1u8; wire::CHALLENGE_NONCE];
        let reg = wire::encode_reg(&id, &c, 1, 3, marker, Duration::from_secs(2)).unwrap();
        assert!(!reg.windows(marker.len()).any(|w| w == marker));
        let key = wire::reg_key(&id);
        let x = wire::Expect {
            nonce: id.nonce(),
            key: &key,
            challenge: &c,
        };
        match wire::parse_reg(&reg, &x) {
            wire::Parsed::Reg(r) => {
                assert!(r.sealed);
                assert_eq!(wire::open_blob(&id, &r).unwrap(), marker);
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
            wire::parse_table(&[1, 0, 0, 0, 9, 0, 0, 0, 0], 2),
            Some(vec![vec![9], vec![]])
        );
        assert_eq!(wire::parse_table(&[1, 0, 0, 0, 9, 0, 0, 0, 0, 7], 2), None);
        assert_eq!(wire::parse_table(&[5, 0, 0, 0, 9], 1), None);
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
