//! Proofs of a shared token, so that the token itself never crosses the
//! wire to a server that may not be who it claims (a forged cluster member,
//! a process squatting on a dead member's port): the challenge-response
//! hello and the signatures on cluster member records (docs/protocol.md,
//! "Hello").
//!
//! Each proof is a BLAKE3 keyed hash under a key derived from the token
//! with a context string of its own, over both sides' fresh nonces: a proof
//! answers one connection and says nothing about the token or any other
//! connection. Both sides prove: the server first (so a client never
//! answers a server that cannot), then the client.

/// Bytes of a nonce (each side draws a fresh one per connection).
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;
/// Longest member id a challenge may name (node ids are 32 hex digits).
pub const MAX_MEMBER_ID_LEN: usize = 128;
/// Bytes of a token id: names which token a client holds without
/// revealing anything that helps guess it (a keyed hash of it).
pub const TOKEN_ID_LEN: usize = 16;

/// A fresh nonce from the kernel's random source.
pub fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut bytes = [0u8; NONCE_LEN];
    getrandom::fill(&mut bytes)
        .map_err(|e| std::io::Error::other(format!("random source: {e}")))?;
    Ok(bytes)
}

/// The keys one token gives: for connection proofs and for its id.
#[derive(Clone)]
pub struct TokenKey {
    proof_key: [u8; 32],
    id: [u8; TOKEN_ID_LEN],
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    pub fn new(token: &[u8]) -> TokenKey {
        let proof_key = blake3::derive_key("kvtier 2026-12 hello proof", token);
        let full_id = blake3::derive_key("kvtier 2026-12 token id", token);
        let mut id = [0u8; TOKEN_ID_LEN];
        id.copy_from_slice(&full_id[..TOKEN_ID_LEN]);
        TokenKey { proof_key, id }
    }

    /// Which token this is, as a client names it in its challenge.
    pub fn id(&self) -> [u8; TOKEN_ID_LEN] {
        self.id
    }

    /// The server's answer to a challenge: it holds the token.
    pub fn server_proof(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        server_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.proof_key);
        h.update(b"server");
        h.update(client_nonce);
        h.update(server_nonce);
        *h.finalize().as_bytes()
    }

    /// The server's answer to a challenge that names the cluster member
    /// the client meant: it holds the token *and* is member `own_id`. A
    /// relay on a dead member's address that passes the challenge on to
    /// a live member gets that member's own id proven back, never the
    /// one the client dialled.
    pub fn server_proof_as(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        server_nonce: &[u8; NONCE_LEN],
        own_id: &str,
    ) -> [u8; PROOF_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.proof_key);
        h.update(b"server as member");
        h.update(client_nonce);
        h.update(server_nonce);
        h.update(&(own_id.len() as u64).to_le_bytes());
        h.update(own_id.as_bytes());
        *h.finalize().as_bytes()
    }

    /// The client's hello proof after a challenge that named `member`:
    /// bound to the namespace and to the member it meant.
    pub fn client_proof_for(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        server_nonce: &[u8; NONCE_LEN],
        namespace: &str,
        member: &str,
    ) -> [u8; PROOF_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.proof_key);
        h.update(b"client for member");
        h.update(server_nonce);
        h.update(client_nonce);
        h.update(&(namespace.len() as u64).to_le_bytes());
        h.update(namespace.as_bytes());
        h.update(&(member.len() as u64).to_le_bytes());
        h.update(member.as_bytes());
        *h.finalize().as_bytes()
    }

    /// The client's proof in its hello, bound to the namespace it asks
    /// for (a relay cannot swap the namespace).
    pub fn client_proof(
        &self,
        client_nonce: &[u8; NONCE_LEN],
        server_nonce: &[u8; NONCE_LEN],
        namespace: &str,
    ) -> [u8; PROOF_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.proof_key);
        h.update(b"client");
        h.update(server_nonce);
        h.update(client_nonce);
        h.update(&(namespace.len() as u64).to_le_bytes());
        h.update(namespace.as_bytes());
        *h.finalize().as_bytes()
    }
}

/// Constant-time equality of a presented proof and the expected one.
pub fn proofs_equal(presented: &[u8], expected: &[u8; PROOF_LEN]) -> bool {
    use subtle::ConstantTimeEq;
    presented.len() == PROOF_LEN && bool::from(presented.ct_eq(expected))
}

/// The key that signs cluster member records: anyone who can write to
/// etcd but does not hold the cluster token cannot make a record the
/// members accept.
pub fn member_record_key(token: &[u8]) -> [u8; 32] {
    blake3::derive_key("kvtier 2026-12 member record", token)
}

/// The signature of a member record stored under `etcd_key`.
pub fn sign_record(key: &[u8; 32], etcd_key: &[u8], record: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&(etcd_key.len() as u64).to_le_bytes());
    h.update(etcd_key);
    h.update(record);
    *h.finalize().as_bytes()
}

/// Whether `signature` signs `record` under `etcd_key` (constant time).
pub fn record_signed(key: &[u8; 32], etcd_key: &[u8], record: &[u8], signature: &[u8]) -> bool {
    proofs_equal(signature, &sign_record(key, etcd_key, record))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_token_both_nonces_and_the_namespace() {
        let a = TokenKey::new(b"token-a-0123456789abcdef");
        let b = TokenKey::new(b"token-b-0123456789abcdef");
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        let p = a.client_proof(&cn, &sn, "ns");
        assert!(proofs_equal(&p, &a.client_proof(&cn, &sn, "ns")));
        assert!(!proofs_equal(&p, &b.client_proof(&cn, &sn, "ns")));
        assert!(!proofs_equal(&p, &a.client_proof(&sn, &cn, "ns")));
        assert!(!proofs_equal(&p, &a.client_proof(&cn, &sn, "nt")));
        assert!(!proofs_equal(&p, &a.server_proof(&cn, &sn)));
        assert!(!proofs_equal(&p[..31], &p));
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn records_are_signed_under_their_key() {
        let k = member_record_key(b"cluster-token-0123456789");
        let s = sign_record(&k, b"/kvtier/c/members/n1", b"{}");
        assert!(record_signed(&k, b"/kvtier/c/members/n1", b"{}", &s));
        assert!(!record_signed(&k, b"/kvtier/c/members/n2", b"{}", &s));
        assert!(!record_signed(&k, b"/kvtier/c/members/n1", b"{ }", &s));
        let other = member_record_key(b"other-token-0123456789ab");
        assert!(!record_signed(&other, b"/kvtier/c/members/n1", b"{}", &s));
    }
}
