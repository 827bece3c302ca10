//! Idle connections to the other members, bounded per member: a peer's
//! connection is fixed to one namespace at its hello, so a pool keyed by
//! (member, namespace) alone would keep one connection per namespace a
//! client ever named, without end (a client cycling made-up namespaces
//! filled another node's connection slots this way). Here each member
//! keeps at most `per_member` idle connections, whatever their
//! namespaces: the least recently used one is closed to make room, and
//! any left idle for `max_idle` is closed when the member is next used.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Idle connections per member at most, by default.
pub const IDLE_PER_MEMBER: usize = 16;
/// An idle connection is closed after this, by default.
pub const MAX_IDLE: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct IdlePool<C> {
    /// Per member: (namespace, connection, idle since), oldest first.
    members: HashMap<String, VecDeque<(String, C, Instant)>>,
    per_member: usize,
    max_idle: Duration,
}

impl<C> IdlePool<C> {
    pub fn new(per_member: usize, max_idle: Duration) -> Self {
        IdlePool {
            members: HashMap::new(),
            per_member: per_member.max(1),
            max_idle,
        }
    }

    /// The most recently returned idle connection to `member` in
    /// `namespace`, if any (after closing those idle too long).
    pub fn take(&mut self, member: &str, namespace: &str, now: Instant) -> Option<C> {
        let idle = self.members.get_mut(member)?;
        let max_idle = self.max_idle;
        idle.retain(|(_, _, since)| now.duration_since(*since) < max_idle);
        let at = idle.iter().rposition(|(ns, _, _)| ns == namespace)?;
        let (_, connection, _) = idle.remove(at)?;
        if idle.is_empty() {
            self.members.remove(member);
        }
        Some(connection)
    }

    /// Keeps `connection` for reuse, closing the member's least recently
    /// used one if it has `per_member` already.
    pub fn put(&mut self, member: &str, namespace: &str, connection: C, now: Instant) {
        let idle = self.members.entry(member.to_string()).or_default();
        while idle.len() >= self.per_member {
            idle.pop_front();
        }
        idle.push_back((namespace.to_string(), connection, now));
    }

    /// Closes every idle connection to `member` (it failed a call).
    pub fn forget(&mut self, member: &str) {
        self.members.remove(member);
    }

    /// Idle connections to `member` now.
    #[cfg(test)]
    pub fn idle(&self, member: &str) -> usize {
        self.members.get(member).map_or(0, VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_up_namespaces_cannot_grow_a_members_idle_connections() {
        let mut pool = IdlePool::new(4, Duration::from_secs(30));
        let now = Instant::now();
        for ns in 0..1000 {
            pool.put("b", &format!("ns-{ns}"), ns, now);
            assert!(pool.idle("b") <= 4);
        }
        assert_eq!(pool.idle("b"), 4);
        // The least recently used went first: the newest four remain.
        assert_eq!(pool.take("b", "ns-999", now), Some(999));
        assert_eq!(pool.take("b", "ns-0", now), None);
        assert_eq!(pool.take("b", "ns-996", now), Some(996));
        // Other members are not touched.
        pool.put("c", "ns-0", 7, now);
        assert_eq!(pool.idle("c"), 1);
        pool.forget("b");
        assert_eq!(pool.idle("b"), 0);
        assert_eq!(pool.idle("c"), 1);
    }

    #[test]
    fn connections_idle_too_long_are_closed_and_reuse_is_by_namespace() {
        let mut pool = IdlePool::new(8, Duration::from_secs(30));
        let start = Instant::now();
        pool.put("b", "x", 1, start);
        pool.put("b", "y", 2, start + Duration::from_secs(20));
        pool.put("b", "x", 3, start + Duration::from_secs(25));
        let later = start + Duration::from_secs(40);
        // 1 has been idle 40 s: closed; 3 is the most recent x.
        assert_eq!(pool.take("b", "x", later), Some(3));
        assert_eq!(pool.take("b", "x", later), None);
        assert_eq!(pool.idle("b"), 1);
        assert_eq!(pool.take("b", "y", later), Some(2));
        assert_eq!(pool.idle("b"), 0);
    }
}
