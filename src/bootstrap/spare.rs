//! Rendezvous without a new unique id: every rank keeps a listener bound from init (its
//! "spare root") and publishes its address in its blob, so that ranks can later make a new
//! communicator from an existing one even when some of its ranks are gone (NCCL's
//! `ncclCommShrink`, `ncclCommGrow`). Every rank computes the new id by itself
//! ([`derived_id`]): the root is one agreed rank's spare listener, and the nonce and secret
//! come from the parent's job key and a label that names the operation, its sequence
//! number and its arguments. So ranks that disagree on the arguments get different keys and
//! are refused by the root like strangers, and nobody outside the job can compute the id.

use std::net::{IpAddr, SocketAddr, TcpListener};

use super::auth::JobKey;
use super::{spawn_root, UniqueId, SECRET_BYTES};
use crate::error::{Error, Result};

/// A listener kept open for a later rendezvous (no thread: connections wait in the
/// kernel's queue until a rendezvous is served on it).
pub struct SpareRoot {
    listener: TcpListener,
    addr: SocketAddr,
}

impl SpareRoot {
    /// Bind a spare root on `ip` (any free port).
    pub fn bind(ip: IpAddr) -> Result<SpareRoot> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::sys(format!("bind a spare rendezvous listener on {ip}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::sys("getsockname of the spare rendezvous listener", e))?;
        Ok(SpareRoot { listener, addr })
    }

    /// Its address (published in the rank's blob).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serve the rendezvous of `id` on this listener in a background thread (it ends with
    /// the rendezvous, as [`UniqueId::new`]'s root does); the listener stays for later ones.
    pub fn serve(&self, id: UniqueId) -> Result<()> {
        let (root, _) = id.root()?;
        if root != self.addr {
            return Err(Error::Internal(format!(
                "a rendezvous for {root} served on the spare listener at {}",
                self.addr
            )));
        }
        let l = self
            .listener
            .try_clone()
            .map_err(|e| Error::sys("dup of the spare rendezvous listener", e))?;
        spawn_root(l, id);
        Ok(())
    }
}

/// The id of a rendezvous at `root` that every rank of a job computes alike: nonce and
/// secret are HMAC-SHA256(`key`, `label`); encrypted when the parent was.
pub fn derived_id(root: SocketAddr, key: &JobKey, label: &[u8], encrypt: bool) -> UniqueId {
    let d = key.derive(label);
    let b = d.bytes();
    let nonce = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
    let mut secret = [0u8; SECRET_BYTES];
    secret.copy_from_slice(&b[8..8 + SECRET_BYTES]);
    UniqueId::from_parts(root, nonce, Some(secret), encrypt)
}

/// A spare root's address as 24 bytes of a blob: [`super::ifaces::put_addr`]'s 20 bytes
/// (family 0: none), then 4 reserved.
pub fn encode_addr(a: Option<SocketAddr>) -> [u8; 24] {
    let mut b = [0u8; 24];
    if let Some(a) = a {
        super::ifaces::put_addr(&mut b, a);
    }
    b
}

/// The inverse of [`encode_addr`]; `None` for no address or an unknown family.
pub fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    super::ifaces::get_addr(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_ids_depend_on_every_input() {
        for a in ["127.0.0.1:4000", "[::1]:9"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(decode_addr(&encode_addr(Some(a))), Some(a));
        }
        assert_eq!(decode_addr(&encode_addr(None)), None);
        let key = JobKey::from_secret(b"s", b"c");
        let at: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let id = derived_id(at, &key, b"shrink 0 [3]", false);
        assert_eq!(id, derived_id(at, &key, b"shrink 0 [3]", false));
        assert_eq!(id.root().unwrap().0, at);
        assert!(id.has_secret() && !id.encrypted());
        assert_ne!(id, derived_id(at, &key, b"shrink 0 [2]", false));
        assert_ne!(
            id,
            derived_id(at, &JobKey::from_secret(b"t", b"c"), b"shrink 0 [3]", false)
        );
        assert!(derived_id(at, &key, b"shrink 0 [3]", true).encrypted());
    }
}
