//! What the batcher's and the publisher's tests share: events as the
//! store emits them, a count of bytes in a payload, and a feed's
//! configuration with a governor of its own.

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

/// A feed's configuration on loopback, port 0, node `n1`, drawing on a
/// governor of its own for `tenants` tenants (guesses: 10 a second, each
/// refusal answered after a second, as the server's defaults).
pub(crate) fn config_for(tenants: usize) -> crate::KvEventsConfig {
    crate::KvEventsConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        "n1",
        kvtier_governor::Governor::new(
            tenants,
            kvtier_governor::Shares::default(),
            kvtier_governor::GuessBudget::new(10, std::time::Duration::from_secs(1)),
        ),
    )
}

pub(crate) fn config() -> crate::KvEventsConfig {
    config_for(0)
}
