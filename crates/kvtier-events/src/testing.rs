//! What the batcher's and the publisher's tests share: events as the
//! store emits them, and a count of bytes in a payload.

use kvtier::{BlockEvent, KeyDigest, Medium, QualifiedKey};

pub(crate) fn qualified(ns: &str, key: &[u8]) -> QualifiedKey {
    let mut q = vec![ns.len() as u8];
    q.extend_from_slice(ns.as_bytes());
    q.extend_from_slice(key);
    QualifiedKey::new(&q).unwrap()
}

pub(crate) fn stored(ns: &str, key: &[u8], digest: u128, medium: Medium) -> BlockEvent {
    BlockEvent::Stored {
        medium,
        digest: KeyDigest(digest),
        qualified: qualified(ns, key),
    }
}

pub(crate) fn contains(payload: &[u8], needle: &[u8]) -> usize {
    payload
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}
