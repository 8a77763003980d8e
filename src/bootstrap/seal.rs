//! Encryption of a job's traffic (`ROCCL_ENCRYPT=1`, or `ncclSetEncryption` in the
//! NCCL-named library): the bootstrap's registrations and replies and every TCP connection's
//! bytes are sealed with AES-256-GCM (the `ring` crate: no cryptography of roccl's own),
//! under keys derived from the job key ([`super::auth::JobKey`]), each key used for one
//! direction of one stream with a counter as its nonce, so no nonce repeats under a key.
//!
//! Whether a job encrypts is a property of its unique id (a flag set where the id is made,
//! [`super::UniqueId::encrypted`]); this module keeps the process's request (the variable,
//! or a call) and the optional pre-shared key mixed into the job key.

use std::sync::atomic::{AtomicU8, Ordering};

use parking_lot::Mutex;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

use super::auth::JobKey;

/// Bytes of a sealed message's authentication tag (AES-GCM's).
pub const SEAL_TAG: usize = 16;

/// An AES-256-GCM key for one use (one stream direction, or one kind of bootstrap message).
pub struct SealKey(LessSafeKey);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

/// The 96-bit nonce of message `n` of a stream: four zero bytes, then `n` big-endian.
pub fn counter_nonce(n: u64) -> [u8; NONCE_LEN] {
    let mut b = [0u8; NONCE_LEN];
    b[4..].copy_from_slice(&n.to_be_bytes());
    b
}

impl SealKey {
    /// The AES-256-GCM key of `key`'s 256 bits.
    pub fn new(key: &JobKey) -> SealKey {
        // A 32-byte key is what AES-256-GCM takes: this cannot fail.
        let k = UnboundKey::new(&AES_256_GCM, key.bytes()).expect("a 256-bit AES-GCM key");
        SealKey(LessSafeKey::new(k))
    }

    /// Encrypt `data` in place under `nonce`, authenticating `aad` with it; returns the tag.
    pub fn seal(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8]) -> [u8; SEAL_TAG] {
        let tag = self
            .0
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), data)
            // Sealing fails only for inputs beyond AES-GCM's limit (64 GiB), far above any
            // message sealed here.
            .expect("AES-GCM seals messages below 64 GiB");
        let mut t = [0u8; SEAL_TAG];
        t.copy_from_slice(tag.as_ref());
        t
    }

    /// Decrypt `data` in place if `tag` authenticates it and `aad` under `nonce`; false (and
    /// `data` unspecified) when it does not.
    pub fn open(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8], tag: &[u8]) -> bool {
        let Ok(tag) = <[u8; SEAL_TAG]>::try_from(tag) else {
            return false;
        };
        self.0
            .open_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                ring::aead::Tag::from(tag),
                data,
                0..,
            )
            .is_ok()
    }

    /// `nonce ‖ ciphertext ‖ tag` of `plain` under a random nonce (bootstrap messages, each
    /// sealed once under its key).
    pub fn seal_random(&self, aad: &[u8], plain: &[u8]) -> crate::error::Result<Vec<u8>> {
        let nonce = super::auth::random::<NONCE_LEN>()?;
        let mut out = Vec::with_capacity(NONCE_LEN + plain.len() + SEAL_TAG);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let tag = self.seal(nonce, aad, &mut out[NONCE_LEN..]);
        out.extend_from_slice(&tag);
        Ok(out)
    }

    /// The plaintext of a [`SealKey::seal_random`] message, or `None` when it does not
    /// authenticate.
    pub fn open_random(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < NONCE_LEN + SEAL_TAG {
            return None;
        }
        let nonce: [u8; NONCE_LEN] = sealed[..NONCE_LEN].try_into().ok()?;
        let end = sealed.len() - SEAL_TAG;
        let mut plain = sealed[NONCE_LEN..end].to_vec();
        self.open(nonce, aad, &mut plain, &sealed[end..])
            .then_some(plain)
    }
}

/// Bytes [`SealKey::seal_random`] adds to a message.
pub const SEAL_OVERHEAD: usize = NONCE_LEN + SEAL_TAG;

/// The process's request, made by a call: 0 none (the environment decides), 1 off, 2 on.
static SET: AtomicU8 = AtomicU8::new(0);

/// The pre-shared key given by a call (`ncclSetEncryption`'s `psk`), and the last key
/// stretched from it with its salt (stretching takes a fraction of a second: once per job).
struct Psk {
    bytes: Vec<u8>,
    stretched: Option<(Vec<u8>, JobKey)>,
}

static PSK: Mutex<Option<Psk>> = Mutex::new(None);

/// Shortest pre-shared key [`set`] takes, in bytes.
pub const MIN_PSK_BYTES: usize = 16;

/// Whether ids made in this process encrypt their jobs: after [`set`], what it said;
/// otherwise `ROCCL_ENCRYPT` (default off).
pub fn requested() -> bool {
    match SET.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => crate::envvar::switch_or("ROCCL_ENCRYPT", false),
    }
}

/// Ask for encryption (or not) in this process, over `ROCCL_ENCRYPT`, with an optional
/// pre-shared key that every rank must give alike: it is mixed into the job key
/// ([`mix_psk`]), so ranks with another (or no) key cannot join. Affects ids and
/// communicators made afterwards. A key shorter than [`MIN_PSK_BYTES`] is refused.
pub fn set(on: bool, psk: Option<&[u8]>) -> crate::error::Result<()> {
    if let Some(p) = psk {
        if p.len() < MIN_PSK_BYTES {
            return Err(crate::error::Error::arg(format!(
                "the pre-shared key is {} bytes: use at least {MIN_PSK_BYTES} (e.g. 32 hex digits from `openssl rand -hex 16`); a short key can be guessed offline from any tag on the wire",
                p.len()
            )));
        }
    }
    SET.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    *PSK.lock() = psk.map(|p| Psk {
        bytes: p.to_vec(),
        stretched: None,
    });
    Ok(())
}

/// Whether a pre-shared key was given ([`set`]): a job key that does not come from a
/// secret in the id may still be one nobody else can compute.
pub fn has_psk() -> bool {
    PSK.lock().is_some()
}

/// `key` with the pre-shared key of [`set`] mixed in, stretched with `salt` (the id's
/// public bytes) by [`super::auth::stretch`]; unchanged without one.
pub fn mix_psk(key: JobKey, salt: &[u8]) -> JobKey {
    let mut psk = PSK.lock();
    let Some(p) = psk.as_mut() else {
        return key;
    };
    let stretched = match &p.stretched {
        Some((s, k)) if s == salt => *k,
        _ => {
            let s = super::auth::stretch(&p.bytes, &[b"roccl pre-shared key v2 ", salt].concat());
            let k = JobKey::from_secret(&s, b"roccl pre-shared key v2");
            p.stretched = Some((salt.to_vec(), k));
            k
        }
    };
    key.derive(stretched.bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_messages_open_only_with_their_key_nonce_and_data() {
        let k = SealKey::new(&JobKey::from_secret(&[7; 16], b"t"));
        let mut m = b"an all-reduce's bytes".to_vec();
        let tag = k.seal(counter_nonce(3), b"hdr", &mut m);
        assert_ne!(&m[..], b"an all-reduce's bytes");
        let sealed = m.clone();
        assert!(k.open(counter_nonce(3), b"hdr", &mut m, &tag));
        assert_eq!(&m[..], b"an all-reduce's bytes");
        for (nonce, aad, flip, key) in [
            (4, &b"hdr"[..], None, 7),
            (3, &b"hdx"[..], None, 7),
            (3, &b"hdr"[..], Some(5), 7),
            (3, &b"hdr"[..], None, 8),
        ] {
            let mut c = sealed.clone();
            if let Some(i) = flip {
                c[i] ^= 1;
            }
            let key = SealKey::new(&JobKey::from_secret(&[key; 16], b"t"));
            assert!(!key.open(counter_nonce(nonce), aad, &mut c, &tag));
        }
        let r = k.seal_random(b"a", b"blob").unwrap();
        assert_eq!(r.len(), 4 + SEAL_OVERHEAD);
        assert_eq!(k.open_random(b"a", &r).unwrap(), b"blob");
        assert!(k.open_random(b"b", &r).is_none());
        assert!(k.open_random(b"a", &r[..r.len() - 1]).is_none());
        assert_ne!(k.seal_random(b"a", b"blob").unwrap(), r, "random nonces");
    }
}
