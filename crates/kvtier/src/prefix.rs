//! Chained prefix keys for token blocks.
//!
//! A prompt is cut into blocks of `block_size` tokens. Block `i`'s key is
//!
//! ```text
//! key[i] = BLAKE3( key[i-1] (32 bytes; 32 zero bytes for i = 0)
//!                || salt length (u32 LE) || salt
//!                || each token of block i as u32 LE )
//! ```
//!
//! so a key names the whole prefix up to and including its block: two prompts
//! share key `i` exactly when their first `(i + 1) * block_size` tokens and
//! salts agree. BLAKE3 (256 bits) because the tokens come from users: with a
//! non-cryptographic hash, one user could craft a prompt whose block key
//! equals another user's and have the engine load its KV bytes (the attack
//! that moved vLLM to SHA-256 prefix hashes). The salt separates adapters or
//! tenants inside one namespace; the store's namespace (see
//! `Store::namespace`) separates models, dtypes and layouts. A trailing
//! partial block gets no key, since its KV bytes would change once the block
//! fills.

/// A 32-byte chained block key; use it wherever a key is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 32]);

impl AsRef<[u8]> for BlockKey {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl BlockKey {
    /// Lower-case hex, handy for logs and the CLI.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Keys for each full block of `tokens`. Panics if `block_size` is zero.
pub fn block_keys(tokens: &[u32], block_size: usize, salt: &[u8]) -> Vec<BlockKey> {
    assert!(block_size > 0, "block_size must be at least 1");
    let mut keys = Vec::with_capacity(tokens.len() / block_size);
    let mut previous = [0u8; 32];
    let mut input = Vec::with_capacity(32 + 4 + salt.len() + block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        input.clear();
        input.extend_from_slice(&previous);
        input.extend_from_slice(&(salt.len() as u32).to_le_bytes());
        input.extend_from_slice(salt);
        for token in block {
            input.extend_from_slice(&token.to_le_bytes());
        }
        previous = *blake3::hash(&input).as_bytes();
        keys.push(BlockKey(previous));
    }
    keys
}
