//! Per-job secret proofs: the challenge-response digest with which a process shows it holds the
//! job secret, the nonces that challenge it, and the kernel randomness both draw on.
//!
//! The bootstrap's TCP listeners and the fd server's Unix sockets both challenge with a fresh
//! `nonce[NONCE_LEN]` and expect `SHA-256(secret | nonce | label)` back, each protocol with its own
//! label so a proof made for one is worthless to the other. This module owns that construction,
//! the constant-time comparison of proofs and the reading of `/dev/urandom`. It must never reveal
//! the secret (no logging, no output derived from it other than digests), never compare a proof in
//! time that depends on its contents, and never fall back to a weaker random source.

use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Read;

/// Length of a challenge nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Length of a proof, [`auth_digest`]'s output.
pub(crate) const DIGEST_LEN: usize = 32;

/// SHA-256(secret | nonce | label): proves knowledge of the job secret for one challenge.
pub(crate) fn auth_digest(secret: &[u8], nonce: &[u8], label: &[u8]) -> [u8; DIGEST_LEN] {
    let mut h = Sha256::new();
    h.update(secret);
    h.update(nonce);
    h.update(label);
    h.finalize().into()
}

/// HMAC-SHA-256 (RFC 2104) of the concatenated `parts` under `key`: the bootstrap's per-connection
/// frame key and its frames' tags (`bootstrap::wire`). Written here over `sha2` (no HMAC crate is
/// in the build).
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; DIGEST_LEN] {
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        block[..DIGEST_LEN].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|k| k ^ byte);
    let mut inner = Sha256::new();
    inner.update(pad(0x36));
    for part in parts {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(pad(0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Compares two byte strings in time that depends only on their lengths.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `N` bytes from the kernel's random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(b)
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        // Test case 1: a 20-byte key.
        assert_eq!(
            hex(hmac_sha256(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2, the data in two parts.
        assert_eq!(
            hex(hmac_sha256(
                b"Jefe",
                &[b"what do ya want ", b"for nothing?"]
            )),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        assert_eq!(
            hex(hmac_sha256(
                &[0xaa; 131],
                &[b"Test Using Larger Than Block-Size Key - Hash Key First"]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn helpers() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
        let a: [u8; 32] = random_bytes().unwrap();
        let b: [u8; 32] = random_bytes().unwrap();
        assert_ne!(a, b);
    }
}
