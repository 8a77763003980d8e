//! The bootstrap root's wire format, without I/O: the challenge, registrations and replies.
//!
//! All little endian. On accepting a connection the root sends a **challenge**: `magic u32
//! "RCH1"` and 16 bytes from the OS random source, new for every connection. The rank answers
//! with its **registration**: a 28-byte header (`magic u32` "RBS4", or "RBS5" for an encrypted
//! job; `nonce u64` of the id; `rank u32`; `nranks u32`; `blob_len u32`; `timeout_ms u32`), a
//! 16-byte tag over challenge ‖ header, the blob (sealed in an encrypted job), and a 16-byte
//! tag over challenge ‖ header ‖ header tag ‖ blob. Tags are HMAC-SHA256 under a key derived
//! from the job key ([`super::auth`]). So the root checks the header before it buffers a
//! blob (a stranger costs it at most a header), and a registration recorded once is worth
//! nothing later: it answers another challenge.
//!
//! The root's **reply**: `status u8` (0: the table, 1: an error, 2: timed out), `len u32`, the payload (the
//! table — each rank's blob as `len u32`, bytes — sealed for the rank in an encrypted job; or
//! a UTF-8 message), and a 16-byte tag over the registration's tag ‖ status ‖ len ‖ payload
//! under the job's reply key. A rank takes only a reply whose tag checks: a process that
//! squats the root's port gets registrations it cannot use and cannot answer them.

use std::time::Duration;

use super::{auth, seal, UniqueId};

/// Magic of the root's challenge.
pub(super) const CHALLENGE_MAGIC: u32 = 0x3148_4352; // "RCH1"
/// Bytes of the challenge: magic and 16 random bytes.
pub(super) const CHALLENGE_BYTES: usize = 4 + CHALLENGE_NONCE;
/// Random bytes of a challenge.
pub(super) const CHALLENGE_NONCE: usize = 16;
const REG_MAGIC: u32 = 0x3453_4252; // "RBS4"
/// Magic of a registration of an encrypted job: its blob is sealed, and so is the reply.
const SEALED_REG_MAGIC: u32 = 0x3553_4252; // "RBS5"
/// Magics of older roccl versions' registrations: answered with an error naming the version
/// mismatch rather than dropped.
const OLD_REG_MAGICS: [u32; 3] = [0x5453_4252, 0x3253_4252, 0x3353_4252]; // RBST RBS2 RBS3
/// Bytes of a registration's header.
pub(super) const REG_HDR: usize = 28;
/// Largest blob a rank may register.
pub(super) const MAX_BLOB: usize = 1 << 20;
/// Largest error message a reply may carry.
pub(super) const MAX_ERROR: usize = 64 << 10;
const TAG: usize = auth::TAG_BYTES;

/// A challenge: its bytes on the wire.
pub(super) fn challenge_bytes(nonce: &[u8; CHALLENGE_NONCE]) -> [u8; CHALLENGE_BYTES] {
    let mut b = [0u8; CHALLENGE_BYTES];
    b[..4].copy_from_slice(&CHALLENGE_MAGIC.to_le_bytes());
    b[4..].copy_from_slice(nonce);
    b
}

/// The random bytes of a challenge, or `None` when `b` is not one.
pub(super) fn parse_challenge(b: &[u8; CHALLENGE_BYTES]) -> Option<[u8; CHALLENGE_NONCE]> {
    (u32::from_le_bytes(b[..4].try_into().ok()?) == CHALLENGE_MAGIC)
        .then(|| b[4..].try_into().expect("16 bytes"))
}

/// The key blobs of an encrypted job's registrations are sealed with.
fn blob_key(id: &UniqueId) -> seal::SealKey {
    seal::SealKey::new(&id.job_key().derive(b"registration blob seal"))
}

/// The key an encrypted job's reply tables are sealed with (each bound to its registration).
pub(super) fn table_key(id: &UniqueId) -> seal::SealKey {
    seal::SealKey::new(&id.job_key().derive(b"reply table seal"))
}

/// The key registrations are tagged with.
pub(super) fn reg_key(id: &UniqueId) -> auth::JobKey {
    id.job_key().derive(b"registration v4")
}

/// The key replies are tagged with.
pub(super) fn reply_key(id: &UniqueId) -> auth::JobKey {
    id.job_key().derive(b"reply v4")
}

/// A registration answering `challenge`: header, header tag, blob, tag.
pub(super) fn encode_reg(
    id: &UniqueId,
    challenge: &[u8; CHALLENGE_NONCE],
    rank: usize,
    nranks: usize,
    blob: &[u8],
    timeout: Duration,
) -> crate::error::Result<Vec<u8>> {
    let sealed;
    let (magic, blob) = if id.encrypted() {
        sealed = blob_key(id).seal_random(&[], blob)?;
        (SEALED_REG_MAGIC, &sealed[..])
    } else {
        (REG_MAGIC, blob)
    };
    let key = reg_key(id);
    let mut msg = Vec::with_capacity(REG_HDR + blob.len() + 2 * TAG);
    msg.extend_from_slice(&magic.to_le_bytes());
    msg.extend_from_slice(&id.nonce().to_le_bytes());
    msg.extend_from_slice(&(rank as u32).to_le_bytes());
    msg.extend_from_slice(&(nranks as u32).to_le_bytes());
    msg.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    msg.extend_from_slice(&(timeout.as_millis().min(u32::MAX as u128) as u32).to_le_bytes());
    let header_tag = key.tag(&[challenge, &msg]);
    msg.extend_from_slice(&header_tag);
    msg.extend_from_slice(blob);
    let tag = key.tag(&[challenge, &msg]);
    msg.extend_from_slice(&tag);
    Ok(msg)
}

/// An authenticated registration.
#[derive(Debug)]
pub(super) struct Reg {
    pub rank: usize,
    pub nranks: usize,
    /// As sent: sealed when `sealed` ([`open_blob`]).
    pub blob: Vec<u8>,
    pub timeout: Duration,
    /// The registration is of an encrypted job.
    pub sealed: bool,
    /// Its tag: the reply is bound to it.
    pub tag: [u8; TAG],
}

/// What the bytes a connection sent so far are.
#[derive(Debug)]
pub(super) enum Parsed {
    /// A registration needs this many bytes in all; not all have arrived.
    Need(usize),
    /// A whole registration whose tags check.
    Reg(Reg),
    /// Not a registration of this root's job: why, and whether to answer (a roccl rank
    /// with another id or secret gets told; garbage does not).
    Refused(String, bool),
}

/// What the root checks a registration against: the job's nonce and key, and the challenge
/// it sent on this connection.
pub(super) struct Expect<'a> {
    pub nonce: u64,
    pub key: &'a auth::JobKey,
    pub challenge: &'a [u8; CHALLENGE_NONCE],
}

/// The root's parser: `b` is everything a connection sent so far. Nothing past the header
/// is asked for until the header's tag checks.
pub(super) fn parse_reg(b: &[u8], x: &Expect<'_>) -> Parsed {
    let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    if b.len() < 4 {
        return Parsed::Need(4);
    }
    let magic = u32at(0);
    if OLD_REG_MAGICS.contains(&magic) {
        return Parsed::Refused(
            "a registration of another roccl version: every rank must run the same roccl version"
                .into(),
            true,
        );
    }
    if magic != REG_MAGIC && magic != SEALED_REG_MAGIC {
        return Parsed::Refused("not a roccl registration (bad magic)".into(), false);
    }
    if b.len() < REG_HDR + TAG {
        return Parsed::Need(REG_HDR + TAG);
    }
    if u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")) != x.nonce {
        return Parsed::Refused(
            "the registration is for another communicator (its unique id differs: a rank of another job, or of an earlier run on the same port?)".into(),
            true,
        );
    }
    let not_ours = || {
        Parsed::Refused(
            "the registration is not authenticated by this job's secret (every rank must be given the same unique id, or in launcher mode the same ROCCL_JOB_SECRET / ROCCL_JOB_SECRET_FILE and ROCCL_ENCRYPT; with ncclSetEncryption, the same pre-shared key; or it is a registration recorded earlier and replayed)".into(),
            true,
        )
    };
    if !x
        .key
        .verify(&[x.challenge, &b[..REG_HDR]], &b[REG_HDR..REG_HDR + TAG])
    {
        return not_ours();
    }
    let len = u32at(20) as usize;
    if len > MAX_BLOB {
        return Parsed::Refused(
            format!("registration blob of {len} bytes is larger than {MAX_BLOB}"),
            true,
        );
    }
    let total = REG_HDR + TAG + len + TAG;
    if b.len() < total {
        return Parsed::Need(total);
    }
    if !x
        .key
        .verify(&[x.challenge, &b[..total - TAG]], &b[total - TAG..total])
    {
        return not_ours();
    }
    Parsed::Reg(Reg {
        rank: u32at(12) as usize,
        nranks: u32at(16) as usize,
        blob: b[REG_HDR + TAG..total - TAG].to_vec(),
        timeout: Duration::from_millis(u32at(24) as u64),
        sealed: magic == SEALED_REG_MAGIC,
        tag: b[total - TAG..total].try_into().expect("16 bytes"),
    })
}

/// The blob of an authenticated registration, opened where the job is encrypted; `Err` with
/// why it is refused (it does not encrypt as the job does, or its blob does not open).
pub(super) fn open_blob(id: &UniqueId, reg: &Reg) -> std::result::Result<Vec<u8>, String> {
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
pub(super) fn other_encryption(b: &[u8], id: &UniqueId) -> bool {
    let other = if id.encrypted() {
        REG_MAGIC
    } else {
        SEALED_REG_MAGIC
    };
    b.len() >= 4 && u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")) == other
}

/// The tag of the registration `b` claims (its last 16 bytes as far as its header says), or
/// zeros: an error reply to it is bound to it.
pub(super) fn claimed_tag(b: &[u8]) -> [u8; TAG] {
    let mut t = [0u8; TAG];
    if b.len() >= REG_HDR + TAG {
        let len = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")) as usize;
        let end = REG_HDR + TAG + len.min(MAX_BLOB) + TAG;
        if b.len() >= end {
            t.copy_from_slice(&b[end - TAG..end]);
        }
    }
    t
}

/// Reply status: the table follows.
pub(super) const STATUS_TABLE: u8 = 0;
/// Reply status: the job is set up wrong (a message follows).
pub(super) const STATUS_ERROR: u8 = 1;
/// Reply status: the rendezvous timed out (a message naming the missing ranks follows).
pub(super) const STATUS_TIMEOUT: u8 = 2;

/// A reply: status, length, payload, tag over the registration's tag and all of it.
pub(super) fn encode_reply(
    key: &auth::JobKey,
    reg_tag: &[u8; TAG],
    status: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len() + TAG);
    out.push(status);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let tag = key.tag(&[reg_tag, &out]);
    out.extend_from_slice(&tag);
    out
}

/// Whether `tag` authenticates the reply `head` (status and length) ‖ `payload` to the
/// registration whose tag is `reg_tag`.
pub(super) fn reply_authentic(
    key: &auth::JobKey,
    reg_tag: &[u8],
    head: &[u8; 5],
    payload: &[u8],
    tag: &[u8],
) -> bool {
    key.verify(&[reg_tag, head, payload], tag)
}

/// The table of every rank's blob: `len u32`, bytes, for each.
pub(super) fn encode_table<'a>(blobs: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut t = Vec::new();
    for b in blobs {
        t.extend_from_slice(&(b.len() as u32).to_le_bytes());
        t.extend_from_slice(b);
    }
    t
}

/// The `nranks` blobs of a reply table (each a u32 LE length and its bytes, nothing after);
/// `None` when it is not one.
pub(super) fn parse_table(mut t: &[u8], nranks: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(nranks.min(1 << 16));
    for _ in 0..nranks {
        let n = u32::from_le_bytes(t.get(..4)?.try_into().ok()?) as usize;
        out.push(t.get(4..4usize.checked_add(n)?)?.to_vec());
        t = &t[4 + n..];
    }
    t.is_empty().then_some(out)
}

/// The fuzz targets' job and challenge.
#[cfg(feature = "fuzzing")]
fn fuzz_job() -> (UniqueId, [u8; CHALLENGE_NONCE]) {
    let id = UniqueId::for_address_with(
        std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
        Some([7; super::SECRET_BYTES]),
    );
    (id, [9; CHALLENGE_NONCE])
}

/// Checks of the root's registration parser without I/O, for the fuzz targets. `sign`:
/// first make `b` a registration of this job as far as its bytes go (the nonce of the key's
/// id, good tags), so that what follows the authentication is reached too.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_registration(b: &[u8], sign: bool) {
    let (id, challenge) = fuzz_job();
    let key = reg_key(&id);
    let x = Expect {
        nonce: id.nonce(),
        key: &key,
        challenge: &challenge,
    };
    let mut b = b.to_vec();
    if sign && b.len() >= REG_HDR + TAG {
        b[4..12].copy_from_slice(&x.nonce.to_le_bytes());
        let t = key.tag(&[&challenge, &b[..REG_HDR]]);
        b[REG_HDR..REG_HDR + TAG].copy_from_slice(&t);
        let len = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
        let total = (REG_HDR + 2 * TAG).saturating_add(len);
        if b.len() >= total {
            let t = key.tag(&[&challenge, &b[..total - TAG]]);
            b[total - TAG..total].copy_from_slice(&t);
        }
    }
    match parse_reg(&b, &x) {
        Parsed::Need(n) => assert!(n > b.len(), "needs {n} of {} bytes", b.len()),
        Parsed::Reg(r) => {
            assert!(r.blob.len() <= MAX_BLOB);
            // A sealed blob of random bytes must be refused, not a panic.
            let _ = open_blob(&id, &r);
        }
        Parsed::Refused(..) => {}
    }
    let _ = claimed_tag(&b);
    let _ = parse_table(&b, (b.first().copied().unwrap_or(0) % 8) as usize);
}

/// A registration of `blob` as rank `rank` of `nranks` for the fuzz targets' job (the one
/// [`fuzz_registration`] signs for): a seed of its corpus.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_seed_registration(rank: usize, nranks: usize, blob: &[u8]) -> Vec<u8> {
    let (id, challenge) = fuzz_job();
    encode_reg(&id, &challenge, rank, nranks, blob, Duration::from_secs(30)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::SECRET_BYTES;

    fn expect<'a>(id: &UniqueId, key: &'a auth::JobKey, c: &'a [u8; 16]) -> Expect<'a> {
        Expect {
            nonce: id.nonce(),
            key,
            challenge: c,
        }
    }

    #[test]
    fn the_parser_takes_only_registrations_of_this_job_and_this_challenge() {
        let id = UniqueId::new().unwrap();
        let key = reg_key(&id);
        let c = [3u8; 16];
        let x = expect(&id, &key, &c);
        let reg = encode_reg(&id, &c, 1, 3, b"blob", Duration::from_secs(2)).unwrap();
        match parse_reg(&reg, &x) {
            Parsed::Reg(r) => {
                assert_eq!((r.rank, r.nranks, r.blob.as_slice()), (1, 3, &b"blob"[..]));
                assert_eq!(r.timeout, Duration::from_secs(2));
                assert_eq!(r.tag, claimed_tag(&reg));
            }
            p => panic!("{p:?}"),
        }
        for k in 0..reg.len() {
            assert!(matches!(parse_reg(&reg[..k], &x), Parsed::Need(_)), "{k}");
        }
        for i in 0..reg.len() {
            let mut b = reg.clone();
            b[i] ^= 1;
            assert!(!matches!(parse_reg(&b, &x), Parsed::Reg(_)), "{i}");
        }
        // The same registration answering another challenge (recorded, then replayed).
        let other_c = [4u8; 16];
        match parse_reg(&reg, &expect(&id, &key, &other_c)) {
            Parsed::Refused(why, true) => assert!(why.contains("replayed"), "{why}"),
            p => panic!("{p:?}"),
        }
        // Same root and nonce, another secret: refused, and told why.
        let other = UniqueId::from_parts(
            id.root().unwrap().0,
            id.nonce(),
            Some([7; SECRET_BYTES]),
            false,
        );
        let forged = encode_reg(&other, &c, 1, 3, b"blob", Duration::from_secs(2)).unwrap();
        match parse_reg(&forged, &x) {
            Parsed::Refused(why, true) => assert!(why.contains("not authenticated"), "{why}"),
            p => panic!("{p:?}"),
        }
        assert!(matches!(
            parse_reg(b"GET / HTTP/1.1", &x),
            Parsed::Refused(_, false)
        ));
        match parse_reg(b"RBS2", &x) {
            Parsed::Refused(why, true) => assert!(why.contains("roccl version"), "{why}"),
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn a_header_announcing_a_large_blob_is_refused_before_its_blob_is_read() {
        let id = UniqueId::new().unwrap();
        let key = reg_key(&id);
        let c = [3u8; 16];
        let x = expect(&id, &key, &c);
        let reg = encode_reg(&id, &c, 0, 2, &[5u8; 1000], Duration::from_secs(2)).unwrap();
        // A stranger's header (bad tag) announcing the largest blob: refused on the header,
        // never `Need` of a megabyte.
        let mut hdr = reg[..REG_HDR + TAG].to_vec();
        hdr[20..24].copy_from_slice(&(MAX_BLOB as u32).to_le_bytes());
        assert!(matches!(parse_reg(&hdr, &x), Parsed::Refused(_, true)));
        // The job's own header is asked for its blob.
        assert!(matches!(parse_reg(&reg[..REG_HDR + TAG], &x), Parsed::Need(n) if n == reg.len()));
    }

    #[test]
    fn replies_are_bound_to_the_key_and_the_registration() {
        let id = UniqueId::new().unwrap();
        let key = reply_key(&id);
        let reg_tag = [1u8; TAG];
        let r = encode_reply(&key, &reg_tag, STATUS_TABLE, b"table");
        let head: [u8; 5] = r[..5].try_into().unwrap();
        let (payload, tag) = (&r[5..r.len() - TAG], &r[r.len() - TAG..]);
        assert_eq!(payload, b"table");
        assert!(reply_authentic(&key, &reg_tag, &head, payload, tag));
        assert!(!reply_authentic(&key, &[2u8; TAG], &head, payload, tag));
        assert!(!reply_authentic(
            &reply_key(&UniqueId::new().unwrap()),
            &reg_tag,
            &head,
            payload,
            tag
        ));
        assert!(!reply_authentic(&key, &reg_tag, &head, b"tablf", tag));
        let t = encode_table([&b"ab"[..], b"", b"c"].into_iter());
        assert_eq!(
            parse_table(&t, 3).unwrap(),
            vec![b"ab".to_vec(), vec![], b"c".to_vec()]
        );
        assert!(parse_table(&t, 2).is_none() && parse_table(&t[..t.len() - 1], 3).is_none());
        assert_eq!(parse_challenge(&challenge_bytes(&[8; 16])), Some([8; 16]));
        assert_eq!(parse_challenge(&[0; CHALLENGE_BYTES]), None);
    }
}
