//! Job authentication: the key every rendezvous registration and every connection hello
//! is authenticated with, the OS random source, and the bookkeeping of refused strangers.
//!
//! The secret is the 128 bits a [`super::UniqueId`] carries (from the OS random source, or
//! from `ROCCL_JOB_SECRET` in launcher mode). From it and the id's root address and nonce a
//! job key is derived with HMAC-SHA256; each use (registration, a listener's connections)
//! derives its own key from that, and messages carry a 16-byte tag, HMAC-SHA256 truncated
//! (RFC 2104; the `hmac` and `sha2` crates, no cryptography of roccl's own). Tags are checked
//! in constant time.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;

use crate::error::{Error, Result};

/// Bytes of a message authentication tag (HMAC-SHA256 truncated to 128 bits).
pub const TAG_BYTES: usize = 16;

/// A 256-bit key (a job's, or one derived from it for one use). Its bytes are never printed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JobKey([u8; 32]);

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey(..)")
    }
}

fn mac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: this cannot fail.
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length")
}

impl JobKey {
    /// The key of a job whose secret is `secret`, bound to `context` (the id's root address
    /// and nonce): HMAC-SHA256(secret, "roccl job key v1" ‖ context).
    pub fn from_secret(secret: &[u8], context: &[u8]) -> JobKey {
        let mut m = mac(secret);
        m.update(b"roccl job key v1");
        m.update(context);
        JobKey(m.finalize().into_bytes().into())
    }

    /// A key for one use of this one (`label` says which, e.g. a listener's token):
    /// HMAC-SHA256(self, label).
    pub fn derive(&self, label: &[u8]) -> JobKey {
        let mut m = mac(&self.0);
        m.update(label);
        JobKey(m.finalize().into_bytes().into())
    }

    /// The key's 256 bits (for a cipher keyed by it, [`super::seal::SealKey`]).
    pub(crate) fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The tag of the concatenation of `parts`.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_BYTES] {
        let mut m = mac(&self.0);
        for p in parts {
            m.update(p);
        }
        let full = m.finalize().into_bytes();
        let mut t = [0u8; TAG_BYTES];
        t.copy_from_slice(&full[..TAG_BYTES]);
        t
    }

    /// Whether `tag` is the tag of `parts` (compared in constant time).
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        if tag.len() != TAG_BYTES {
            return false;
        }
        let mut m = mac(&self.0);
        for p in parts {
            m.update(p);
        }
        m.verify_truncated_left(tag).is_ok()
    }
}

/// PBKDF2-HMAC-SHA256 rounds a pass phrase or pre-shared key is stretched with (OWASP's
/// figure for PBKDF2-SHA256, 2023): about 0.3 s once per process on a 2024 core, so every
/// guess an eavesdropper checks against a tag costs as much.
pub const STRETCH_ROUNDS: u32 = 600_000;

/// A secret of 128 bits from the pass phrase `phrase`: PBKDF2-HMAC-SHA256 (ring's) with
/// [`STRETCH_ROUNDS`] rounds and `salt` (which names the job, so that no guess carries over
/// from one job to another).
pub fn stretch(phrase: &[u8], salt: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        std::num::NonZeroU32::new(STRETCH_ROUNDS).expect("non-zero rounds"),
        salt,
        phrase,
        &mut out,
    );
    out
}

/// `N` bytes from the operating system's random source (`getrandom(2)`).
pub fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| {
        Error::Internal(format!(
            "the operating system's random source failed ({e}): cannot create a job secret"
        ))
    })?;
    Ok(b)
}

static REFUSED: AtomicU64 = AtomicU64::new(0);
static SEEN: Mutex<Option<HashSet<(&'static str, IpAddr)>>> = Mutex::new(None);

/// Count a stranger refused by the listener `what` (e.g. "bootstrap root", "tcp"); the first
/// refusal from each source address (per listener kind) is logged with `why`.
pub fn refuse(what: &'static str, from: Option<IpAddr>, why: &str) {
    REFUSED.fetch_add(1, Ordering::Relaxed);
    let ip = from.unwrap_or(IpAddr::from([0u8; 4]));
    let first = SEEN
        .lock()
        .get_or_insert_with(HashSet::new)
        .insert((what, ip));
    if first {
        let src = from.map_or("a local process".to_string(), |a| a.to_string());
        crate::warn!(
            "{what}: refused a connection from {src}: {why} (a stranger, a port scan, or a rank of another job; further refusals from this source are counted, not logged)"
        );
    }
}

/// Connections and registrations refused so far in this process (every listener).
pub fn refused() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_key_and_message() {
        let k = JobKey::from_secret(&[1; 16], b"ctx");
        let t = k.tag(&[b"hello", b" world"]);
        assert!(k.verify(&[b"hello world"], &t));
        assert!(!k.verify(&[b"hello worle"], &t));
        let other = JobKey::from_secret(&[2; 16], b"ctx");
        assert!(!other.verify(&[b"hello world"], &t));
        assert!(!JobKey::from_secret(&[1; 16], b"cty").verify(&[b"hello world"], &t));
        assert!(!k.derive(b"a").verify(&[b"hello world"], &t));
        assert!(!k.verify(&[b"hello world"], &t[..8]));
        assert_ne!(random::<16>().unwrap(), random::<16>().unwrap());
    }
}
