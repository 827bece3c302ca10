//! Which members own a key: weighted rendezvous (highest random weight)
//! hashing over the live members. Every node and client computes the same
//! answer from the same member list, with no coordinator: a key's owners
//! change only when one of them leaves or a member that outranks them
//! joins, so a joining member takes about its weight's share of the keys
//! and nothing moves between the others.

use super::Member;
use twox_hash::XxHash3_64;

/// The placement hash of a key in a namespace: the same on every host (no
/// secret in it, unlike the store's key digest, which is private to each
/// data directory). `namespace` is the connection's namespace name.
pub fn key_hash(namespace: &str, key: &[u8]) -> u64 {
    let mut qualified = Vec::with_capacity(1 + namespace.len() + key.len());
    qualified.push(namespace.len() as u8);
    qualified.extend_from_slice(namespace.as_bytes());
    qualified.extend_from_slice(key);
    XxHash3_64::oneshot(&qualified)
}

/// A member's score for a key: `weight / -ln(u)`, with `u` uniform in
/// (0, 1) from the key and the member id. The highest score owns the key;
/// with weights, each member's share of the keys is its share of the total
/// weight (the logarithmic method of Schindelhauer and Schomaker).
fn score(key: u64, member: &Member) -> f64 {
    let seed = XxHash3_64::oneshot(member.id.as_bytes());
    let h = XxHash3_64::oneshot_with_seed(seed, &key.to_le_bytes());
    // 53 bits into (0, 1): never 0, never 1.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let weight = member.capacity.max(1) as f64;
    weight / -u.ln()
}

/// The `replicas` members (fewer if there are fewer) that own `key`, best
/// first. Ties (never seen with 64-bit hashes) break by member id.
pub fn owners(key: u64, members: &[Member], replicas: usize) -> Vec<&Member> {
    let mut scored: Vec<(f64, &Member)> = members.iter().map(|m| (score(key, m), m)).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
    scored.into_iter().take(replicas).map(|(_, m)| m).collect()
}

/// The member that indexes a key of a shared directory in the bounded
/// index mode: the best-scoring member for the key's share hash (the
/// store's `share_hash`, not `key_hash`: the followed records carry digests,
/// not placement hashes), without `owners`' allocation (a node asks it for
/// every record entry it follows). `owners(hash, members, 1)`'s answer.
pub fn index_share_owner(share_hash: u64, members: &[Member]) -> Option<&Member> {
    let mut best: Option<(f64, &Member)> = None;
    for member in members {
        let s = score(share_hash, member);
        let better =
            best.is_none_or(|(top, holder)| s > top || (s == top && member.id < holder.id));
        if better {
            best = Some((s, member));
        }
    }
    best.map(|(_, m)| m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, capacity: u64) -> Member {
        Member {
            id: id.to_string(),
            address: format!("{id}:7700"),
            capacity,
            incarnation: 1,
            admin: None,
            tls: false,
        }
    }

    fn share(members: &[Member], keys: u64) -> Vec<f64> {
        let mut counts = vec![0u64; members.len()];
        for k in 0..keys {
            let owner = owners(key_hash("ns", &k.to_le_bytes()), members, 1)[0];
            counts[members.iter().position(|m| m.id == owner.id).unwrap()] += 1;
        }
        counts.iter().map(|&c| c as f64 / keys as f64).collect()
    }

    #[test]
    fn the_index_share_owner_is_the_first_owner() {
        let members: Vec<Member> = (0..5)
            .map(|i| member(&format!("node-{i}"), (i + 1) << 30))
            .collect();
        for k in 0..5_000u64 {
            let hash = XxHash3_64::oneshot(&k.to_le_bytes());
            assert_eq!(
                index_share_owner(hash, &members).map(|m| &m.id),
                Some(&owners(hash, &members, 1)[0].id)
            );
        }
        assert!(index_share_owner(1, &[]).is_none());
    }

    #[test]
    fn equal_members_share_evenly_and_weights_are_respected() {
        let even: Vec<Member> = (0..3)
            .map(|i| member(&format!("node-{i}"), 1 << 30))
            .collect();
        for s in share(&even, 30_000) {
            assert!((s - 1.0 / 3.0).abs() < 0.02, "{s}");
        }
        let weighted = vec![member("a", 1 << 30), member("b", 3 << 30)];
        let s = share(&weighted, 40_000);
        assert!(
            (s[0] - 0.25).abs() < 0.02 && (s[1] - 0.75).abs() < 0.02,
            "{s:?}"
        );
    }

    #[test]
    fn a_joining_member_moves_about_its_share_and_nothing_else() {
        let three: Vec<Member> = (0..3)
            .map(|i| member(&format!("node-{i}"), 1 << 30))
            .collect();
        let mut four = three.clone();
        four.push(member("node-3", 1 << 30));
        let keys = 20_000u64;
        let mut moved = 0;
        for k in 0..keys {
            let h = key_hash("ns", &k.to_le_bytes());
            let before = &owners(h, &three, 1)[0].id;
            let after = &owners(h, &four, 1)[0].id;
            if before != after {
                assert_eq!(after, "node-3", "a key moved between old members");
                moved += 1;
            }
        }
        let fraction = moved as f64 / keys as f64;
        assert!((fraction - 0.25).abs() < 0.02, "{fraction}");
    }

    #[test]
    fn replicas_are_distinct_and_the_order_does_not_depend_on_the_list() {
        let members: Vec<Member> = (0..5).map(|i| member(&format!("n{i}"), 1 << 30)).collect();
        let mut reversed = members.clone();
        reversed.reverse();
        for k in 0..1000u64 {
            let h = key_hash("", &k.to_le_bytes());
            let a: Vec<&str> = owners(h, &members, 2)
                .iter()
                .map(|m| m.id.as_str())
                .collect();
            let b: Vec<&str> = owners(h, &reversed, 2)
                .iter()
                .map(|m| m.id.as_str())
                .collect();
            assert_eq!(a, b);
            assert_eq!(a.len(), 2);
            assert_ne!(a[0], a[1]);
        }
        assert_eq!(owners(1, &members[..1], 3).len(), 1);
        assert!(owners(1, &[], 1).is_empty());
        // The namespace is part of the placement.
        assert_ne!(key_hash("a", b"k"), key_hash("b", b"k"));
        assert_ne!(key_hash("a", b"bk"), key_hash("ab", b"k"));
    }
}
