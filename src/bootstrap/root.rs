//! The rendezvous root: a thread that challenges every connection, admits one authenticated
//! registration per rank ([`super::wire`]) and, once all `nranks` have arrived, sends every
//! rank the table of all blobs. If the timeout passes first, every waiting rank gets an
//! error that lists the ranks that never arrived.
//!
//! The root never blocks on one connection: it reads every connection without blocking. A
//! connection that has not sent a whole registration [`super::REG_DEADLINE`] after it
//! connected, or that sends garbage, is dropped; with [`MAX_PENDING`] connections pending,
//! the oldest is dropped for a new one (ranks whose connection closes try again until their
//! deadline). A stranger costs the root a registration header at most: the blob is read only
//! once the header's tag checks.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{self, Expect, Parsed, Reg};
use super::{auth, progress_interval, UniqueId, REG_DEADLINE};

/// Most connections the root reads at once; a new one past it replaces the oldest.
pub(super) const MAX_PENDING: usize = 1024;
/// A root nobody registers with gives up after this long.
const ROOT_IDLE: Duration = Duration::from_secs(3600);

/// Serve the rendezvous of `id` on `l` in a thread of its own (it ends with the rendezvous).
pub(super) fn spawn_root(l: TcpListener, id: UniqueId) {
    std::thread::Builder::new()
        .name("roccl-root".into())
        .spawn(move || Root::new(id, &l).run(&l))
        .expect("spawning the bootstrap root thread");
}

/// A connection whose registration has not all arrived.
struct Incoming {
    stream: TcpStream,
    from: SocketAddr,
    got: Vec<u8>,
    deadline: Instant,
    challenge: [u8; wire::CHALLENGE_NONCE],
}

/// A rank whose registration was admitted.
struct Joined {
    stream: TcpStream,
    blob: Vec<u8>,
    from: SocketAddr,
    /// Its registration's tag: the reply is bound to it.
    tag: [u8; auth::TAG_BYTES],
}

struct Root {
    id: UniqueId,
    reg_key: auth::JobKey,
    reply_key: auth::JobKey,
    /// The root's address, for messages.
    at: String,
    joined: BTreeMap<usize, Joined>,
    incoming: VecDeque<Incoming>,
    nranks: Option<usize>,
    /// The job was set up wrong: every rank gets this, also those that register later (until
    /// the timeout), so that none waits out the timeout.
    failed: Option<String>,
    /// When the first registration came (before it: when the root started).
    start: Instant,
    /// The smallest timeout any rank sent.
    timeout: Duration,
    first: bool,
    last_said: Instant,
}

/// Whether the peer of `s` has closed it (or it failed): a rank that joined and is gone.
fn closed(s: &TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let mut b = [0u8; 1];
    let gone = match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    gone
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

/// Send a reply, waiting at most `limit` for the peer to take it.
fn send(s: &mut TcpStream, reply: &[u8], limit: Duration) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(limit));
    let _ = s.write_all(reply);
}

impl Root {
    fn new(id: UniqueId, l: &TcpListener) -> Root {
        let now = Instant::now();
        Root {
            id,
            reg_key: wire::reg_key(&id),
            reply_key: wire::reply_key(&id),
            at: l
                .local_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string()),
            joined: BTreeMap::new(),
            incoming: VecDeque::new(),
            nranks: None,
            failed: None,
            start: now,
            timeout: ROOT_IDLE,
            first: true,
            last_said: now,
        }
    }

    fn run(mut self, l: &TcpListener) {
        let _ = l.set_nonblocking(true);
        loop {
            if let Some(n) = self.nranks {
                if self.joined.len() == n && self.failed.is_none() {
                    break;
                }
            }
            if self.out_of_time() {
                return;
            }
            let mut progressed = self.accept_all(l);
            progressed |= self.read_all();
            if !progressed {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.reply_all();
    }

    /// Ends the rendezvous when its time is up (`true`: the root is done), and says every
    /// few seconds who is still missing.
    fn out_of_time(&mut self) -> bool {
        let elapsed = self.start.elapsed();
        if (self.first && elapsed > ROOT_IDLE) || (self.failed.is_some() && elapsed > self.timeout)
        {
            return true;
        }
        if self.first || self.failed.is_some() {
            return false;
        }
        let n = self.nranks.unwrap_or(0);
        let missing: Vec<usize> = (0..n).filter(|r| !self.joined.contains_key(r)).collect();
        if elapsed > self.timeout {
            let msg = format!(
                "bootstrap timed out after {:.0?} (ROCCL_TIMEOUT): {} of {n} ranks joined; {} never arrived (did they start, and do they use the same unique id / ROCCL_ROOT?)",
                self.timeout,
                self.joined.len(),
                crate::error::ranks_list(&missing)
            );
            self.fail_joined(wire::STATUS_TIMEOUT, &msg);
            return true;
        }
        if self.last_said.elapsed() >= progress_interval(self.timeout) {
            self.last_said = Instant::now();
            let have: Vec<usize> = self.joined.keys().copied().collect();
            crate::warn!(
                "bootstrap root at {}: after {elapsed:.0?}, {} of {n} ranks joined ({}); waiting for {} (gives up after {:.0?}, ROCCL_TIMEOUT)",
                self.at,
                have.len(),
                crate::error::ranks_list(&have),
                crate::error::ranks_list(&missing),
                self.timeout,
            );
        }
        false
    }

    /// Accept every waiting connection and challenge it; whether any came.
    fn accept_all(&mut self, l: &TcpListener) -> bool {
        let mut progressed = false;
        loop {
            match l.accept() {
                Ok((mut s, from)) => {
                    progressed = true;
                    if self.incoming.len() >= MAX_PENDING {
                        // The oldest has had the longest to register; a rank whose
                        // connection this was connects again.
                        if let Some(old) = self.incoming.pop_front() {
                            auth::refuse(
                                "bootstrap root",
                                Some(old.from.ip()),
                                &format!("{MAX_PENDING} connections pending: the oldest is dropped for a new one"),
                            );
                        }
                    }
                    let Ok(challenge) = auth::random::<{ wire::CHALLENGE_NONCE }>() else {
                        continue;
                    };
                    let _ = s.set_nodelay(true);
                    // 20 bytes into an empty socket buffer: this does not block.
                    let _ = s.write_all(&wire::challenge_bytes(&challenge));
                    let _ = s.set_nonblocking(true);
                    self.incoming.push_back(Incoming {
                        stream: s,
                        from,
                        got: Vec::new(),
                        deadline: Instant::now() + REG_DEADLINE,
                        challenge,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // Out of descriptors (or a connection reset before accept): the
                    // listener's trouble, not the rendezvous'; pending ones time out.
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
        progressed
    }

    /// Read every pending connection; admit or refuse those whose registration is whole.
    fn read_all(&mut self) -> bool {
        let mut progressed = false;
        let mut i = 0;
        while i < self.incoming.len() {
            let before = self.incoming[i].got.len();
            let parsed = self.parse(i);
            progressed |= self.incoming[i].got.len() != before;
            match parsed {
                Parsed::Need(_) if Instant::now() < self.incoming[i].deadline => i += 1,
                Parsed::Need(_) => {
                    let c = self.incoming.remove(i).expect("in range");
                    auth::refuse(
                        "bootstrap root",
                        Some(c.from.ip()),
                        &format!(
                            "no whole registration within {REG_DEADLINE:.0?} ({} bytes)",
                            c.got.len()
                        ),
                    );
                }
                Parsed::Refused(why, answer) => {
                    let c = self.incoming.remove(i).expect("in range");
                    self.refuse(c, why, answer);
                }
                Parsed::Reg(r) => {
                    let c = self.incoming.remove(i).expect("in range");
                    self.admit(c, r);
                }
            }
        }
        progressed
    }

    /// Read connection `i` as far as its registration needs and parse it.
    fn parse(&mut self, i: usize) -> Parsed {
        let c = &mut self.incoming[i];
        let challenge = c.challenge;
        let x = Expect {
            nonce: self.id.nonce(),
            key: &self.reg_key,
            challenge: &challenge,
        };
        let mut parsed = wire::parse_reg(&c.got, &x);
        while let Parsed::Need(want) = parsed {
            if let Err(e) = read_some(c, want) {
                return Parsed::Refused(
                    format!("the connection closed before a whole registration ({e})"),
                    false,
                );
            }
            if c.got.len() < want {
                break;
            }
            parsed = wire::parse_reg(&c.got, &x);
        }
        parsed
    }

    /// Refuse a connection: counted, logged once per source, told why if it is a roccl rank.
    fn refuse(&mut self, mut c: Incoming, mut why: String, answer: bool) {
        if answer && wire::other_encryption(&c.got, &self.id) {
            why = format!(
                "a registration {} encryption, but this job {} (ROCCL_ENCRYPT, or ncclSetEncryption, must be the same on every rank)",
                if self.id.encrypted() { "without" } else { "with" },
                if self.id.encrypted() { "encrypts" } else { "does not" },
            );
        }
        auth::refuse("bootstrap root", Some(c.from.ip()), &why);
        if answer {
            let msg = format!("bootstrap root at {}: {why}", self.at);
            let reply = wire::encode_reply(
                &self.reply_key,
                &wire::claimed_tag(&c.got),
                wire::STATUS_ERROR,
                msg.as_bytes(),
            );
            send(&mut c.stream, &reply, Duration::from_secs(1));
        }
    }

    /// Send `msg` to one rank, bound to its registration.
    fn tell(&self, s: &mut TcpStream, tag: &[u8; auth::TAG_BYTES], status: u8, msg: &str) {
        let reply = wire::encode_reply(&self.reply_key, tag, status, msg.as_bytes());
        send(s, &reply, Duration::from_secs(1));
    }

    /// Fail every rank that has joined with `msg`, highest rank first: the root usually runs
    /// inside rank 0's process, which exits as soon as it reads the error, taking this thread
    /// with it; by then every other rank's error is in its socket's send buffer, which the
    /// kernel still delivers.
    fn fail_joined(&mut self, status: u8, msg: &str) {
        let mut joined = std::mem::take(&mut self.joined);
        for j in joined.values_mut().rev() {
            self.tell(&mut j.stream, &j.tag, status, msg);
        }
    }

    /// An authenticated registration: join its rank, or fail the job naming what is wrong.
    fn admit(&mut self, c: Incoming, reg: Reg) {
        let Incoming {
            stream: mut s,
            from,
            ..
        } = c;
        let _ = s.set_nonblocking(false);
        let blob = match wire::open_blob(&self.id, &reg) {
            Ok(b) => b,
            Err(why) => {
                auth::refuse("bootstrap root", Some(from.ip()), &why);
                let msg = format!("bootstrap root at {}: {why}", self.at);
                self.tell(&mut s, &reg.tag, wire::STATUS_ERROR, &msg);
                return;
            }
        };
        if let Some(msg) = &self.failed {
            self.tell(&mut s, &reg.tag, wire::STATUS_ERROR, msg);
            return;
        }
        if self.first {
            self.first = false;
            self.start = Instant::now();
            self.last_said = self.start;
            self.timeout = reg.timeout;
        } else {
            self.timeout = self.timeout.min(reg.timeout);
        }
        let (rank, n) = (reg.rank, reg.nranks);
        let want = *self.nranks.get_or_insert(n);
        let refused = if n != want {
            Some(format!("rank {rank} (from {from}) says there are {n} ranks but earlier ranks said {want}: every rank must pass the same nranks"))
        } else if rank >= n {
            Some(format!(
                "rank {rank} (from {from}) is out of range for {n} ranks"
            ))
        } else {
            // A rank whose earlier connection closed (it was dropped, and tried again) takes
            // its place; two live ones are two processes given one rank.
            self.joined.get(&rank).filter(|j| !closed(&j.stream)).map(|j| format!(
                "rank {rank} joined twice (from {} and from {from}): two processes were given the same rank; check the ranks the launcher hands out",
                j.from
            ))
        };
        if let Some(msg) = refused {
            self.tell(&mut s, &reg.tag, wire::STATUS_ERROR, &msg);
            self.fail_joined(wire::STATUS_ERROR, &msg);
            crate::warn!("bootstrap root: {msg}");
            self.failed = Some(msg);
            return;
        }
        let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
        self.joined.insert(
            rank,
            Joined {
                stream: s,
                blob,
                from,
                tag: reg.tag,
            },
        );
    }

    /// Every rank has joined: send each the table, bound to its registration (sealed for it
    /// in an encrypted job, so that a reply cannot be replayed to another).
    fn reply_all(mut self) {
        let table = wire::encode_table(self.joined.values().map(|j| &j.blob[..]));
        let seal = self.id.encrypted().then(|| wire::table_key(&self.id));
        for j in self.joined.values_mut() {
            let payload = match &seal {
                None => table.clone(),
                Some(k) => match k.seal_random(&j.tag, &table) {
                    Ok(sealed) => sealed,
                    Err(e) => {
                        let msg = format!("bootstrap root: {e}");
                        let reply = wire::encode_reply(
                            &self.reply_key,
                            &j.tag,
                            wire::STATUS_ERROR,
                            msg.as_bytes(),
                        );
                        send(&mut j.stream, &reply, Duration::from_secs(1));
                        continue;
                    }
                },
            };
            let reply = wire::encode_reply(&self.reply_key, &j.tag, wire::STATUS_TABLE, &payload);
            let _ = j.stream.write_all(&reply);
        }
    }
}
