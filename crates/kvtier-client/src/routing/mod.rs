//! A batch whose keys other members own, split by owner and run on all of
//! them at once: this node's share on its store, each other member's share
//! over one pooled connection, in parallel; per-key results come back in
//! the caller's order.
//!
//! Reads try a key's owners in turn (this node first when it is one): a
//! miss or an unreachable owner moves on to the next, and a key no owner
//! answers is a miss. Puts go to every owner (`replicas`); a put succeeds
//! when one owner took it. A member answers only from its own verified
//! store (the requests carry `LOCAL_ONLY`), so a stale view costs a miss,
//! never another key's bytes.

mod direct;
mod idle_pool;
mod peers;

pub use direct::{DirectRouting, ServerView};
pub use peers::{PeerStats, Peers};

use crate::conn::KnownLen;
use kvtier::{NamespacedStore, PutOptions};
use kvtier_wire::cluster::{index_share_owner, key_hash, owners, Member};
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Local,
    /// Index into the router's member list.
    Remote(usize),
}

/// One request's routing, over one snapshot of the member list.
#[derive(Debug)]
pub struct Router<'a> {
    peers: &'a Peers,
    /// This node's store, for its own share (`None` in a client that
    /// routes by itself: it is no member).
    local: Option<&'a NamespacedStore>,
    namespace: &'a str,
    members: Arc<Vec<Member>>,
    me: String,
    replicas: usize,
    /// The bounded index of a shared directory (`by_index_share`): reads
    /// look here, then at the member whose index share holds the key;
    /// everything else stays here.
    by_share: bool,
}

/// Keys (by index) bound for one target.
type Groups = BTreeMap<Target, Vec<usize>>;

/// A read's `round`: each key not yet `settled` goes to the `round`-th
/// place in its read order (keys with fewer places are out of places).
fn round_groups(orders: &[Vec<Target>], settled: &[bool], round: usize) -> Groups {
    let mut groups = Groups::new();
    for (i, order) in orders.iter().enumerate() {
        if let (false, Some(&target)) = (settled[i], order.get(round)) {
            groups.entry(target).or_default().push(i);
        }
    }
    groups
}

/// This node's store, for its own share of a request. A client that
/// routes by itself is no member, so no key of its is ever local to it.
fn here(store: Option<&NamespacedStore>) -> &NamespacedStore {
    store.expect("only a member owns keys locally")
}

/// Each target's key indices with its answer (`None`: unreachable).
type Answers<A> = Vec<((Target, Vec<usize>), Option<A>)>;

impl<'a> Router<'a> {
    /// `None` while the view is empty (before the first registration):
    /// the node then serves alone.
    pub fn new(peers: &'a Peers, namespace: &'a str) -> Option<Router<'a>> {
        let members = peers.view.members();
        if members.is_empty() {
            return None;
        }
        Some(Router {
            peers,
            local: None,
            namespace,
            me: peers.view.me().id,
            replicas: peers.view.replicas(),
            members,
            by_share: false,
        })
    }

    /// The router of a member: keys this node owns go to `store`.
    pub fn with_local(mut self, store: &'a NamespacedStore) -> Router<'a> {
        self.local = Some(store);
        self
    }

    /// A member of a shared directory in the bounded index mode
    /// (docs/cluster.md, "Shared storage"): every node reads every flushed
    /// block from the file system, but indexes only its share of the
    /// other writers' keys. A read looks in this node's store first (its
    /// own log, its share, its memory), then asks the member whose share
    /// holds the key (`index_share_owner` of the store's `share_hash`).
    /// Puts, removes and flushes never leave this node. Needs `with_local`.
    pub fn by_index_share(mut self) -> Router<'a> {
        self.by_share = true;
        self
    }

    /// Whether this router reads by the index share (`by_index_share`).
    pub fn reads_by_index_share(&self) -> bool {
        self.by_share
    }

    /// The member whose index share holds `key`, as a target.
    fn share_owner(&self, key: &[u8]) -> Target {
        let hash = here(self.local).share_hash(key);
        match index_share_owner(hash, &self.members) {
            Some(m) if m.id != self.me => Target::Remote(
                self.members
                    .iter()
                    .position(|x| x.id == m.id)
                    .expect("an owner is a member"),
            ),
            _ => Target::Local,
        }
    }

    /// This node's store, for a member's router.
    pub fn local(&self) -> Option<&'a NamespacedStore> {
        self.local
    }

    /// A key's owners in rank order (by the index share: this node alone,
    /// which takes every put and remove).
    fn owners(&self, key: &[u8]) -> Vec<Target> {
        if self.by_share {
            return vec![Target::Local];
        }
        let hash = key_hash(self.namespace, key);
        owners(hash, &self.members, self.replicas)
            .into_iter()
            .map(|m| {
                if m.id == self.me {
                    Target::Local
                } else {
                    let index = self
                        .members
                        .iter()
                        .position(|x| x.id == m.id)
                        .expect("an owner is a member");
                    Target::Remote(index)
                }
            })
            .collect()
    }

    /// Where a read of `key` looks, in order: this node first if it owns
    /// the key (no hop), then the others by rank.
    fn read_order(&self, key: &[u8]) -> Vec<Target> {
        if self.by_share {
            return match self.share_owner(key) {
                Target::Local => vec![Target::Local],
                owner => vec![Target::Local, owner],
            };
        }
        let mut order = self.owners(key);
        order.sort_by_key(|t| *t != Target::Local);
        order
    }

    /// Whether a read of `key` looks here first (this node owns it).
    pub fn reads_here_first(&self, key: &[u8]) -> bool {
        self.read_order(key).first() == Some(&Target::Local)
    }

    /// Whether this node alone owns every key: then the plain local path
    /// serves the request.
    pub fn all_local<K: AsRef<[u8]>>(&self, keys: &[K]) -> bool {
        if self.by_share {
            return keys
                .iter()
                .all(|k| self.share_owner(k.as_ref()) == Target::Local);
        }
        keys.iter()
            .all(|k| self.owners(k.as_ref()) == [Target::Local])
    }

    /// Reads each key's value into its segments (`dests`), from the first
    /// owner that has it. Values from other members are read from the
    /// socket straight into `dests`: no copy on this host.
    pub fn get(
        &self,
        keys: &[&[u8]],
        dests: &mut [&mut [&mut [u8]]],
    ) -> Vec<kvtier::Result<Option<usize>>> {
        let orders: Vec<Vec<Target>> = keys.iter().map(|k| self.read_order(k)).collect();
        let mut results: Vec<kvtier::Result<Option<usize>>> =
            keys.iter().map(|_| Ok(None)).collect();
        let mut done = vec![false; keys.len()];
        for round in 0.. {
            let groups = round_groups(&orders, &done, round);
            if groups.is_empty() {
                break;
            }
            let mut slots: Vec<Option<&mut [&mut [u8]]>> =
                dests.iter_mut().map(|d| Some(&mut **d)).collect();
            let answers = self.run(
                groups,
                |target, indices| {
                    let group_keys: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                    let bufs: Vec<&mut [&mut [u8]]> = indices
                        .iter()
                        .map(|&i| slots[i].take().expect("a key is in one group per round"))
                        .collect();
                    (target, group_keys, bufs)
                },
                |store_or_peer, (_, group_keys, mut bufs)| match store_or_peer {
                    None => Some(here(self.local).batch_get_segments(&group_keys, &mut bufs)),
                    Some((peers, member, namespace)) => {
                        peers.call(member, namespace, group_keys.len(), |c| {
                            c.batch_get_segments(&group_keys, &mut bufs)
                        })
                    }
                },
            );
            // An owner that could not be reached is a miss there: the
            // next owner is tried.
            for ((_, indices), answer) in answers {
                let Some(per_key) = answer else { continue };
                for (&i, result) in indices.iter().zip(per_key) {
                    match result {
                        Ok(Some(n)) => {
                            results[i] = Ok(Some(n));
                            done[i] = true;
                        }
                        Ok(None) => {}
                        // The value exists and the caller's room is short:
                        // the answer, not a reason to look on.
                        Err(e) if e.kind() == kvtier::ErrorKind::BufferTooSmall => {
                            results[i] = Err(e);
                            done[i] = true;
                        }
                        Err(_) => {}
                    }
                }
            }
        }
        results
    }

    /// Stores each value (given as segments) on every owner of its key.
    pub fn put(
        &self,
        keys: &[&[u8]],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> Vec<kvtier::Result<()>> {
        let owners: Vec<Vec<Target>> = keys.iter().map(|k| self.owners(k)).collect();
        let mut groups = Groups::new();
        for (i, targets) in owners.iter().enumerate() {
            for &target in targets {
                groups.entry(target).or_default().push(i);
            }
        }
        let answers = self.run(
            groups,
            |target, indices| {
                let group_keys: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                let group_values: Vec<&[&[u8]]> = indices.iter().map(|&i| values[i]).collect();
                (target, group_keys, group_values)
            },
            |store_or_peer, (_, group_keys, group_values)| match store_or_peer {
                None => {
                    Some(here(self.local).batch_put_segments(&group_keys, &group_values, options))
                }
                Some((peers, member, namespace)) => {
                    peers.call(member, namespace, group_keys.len(), |c| {
                        c.batch_put_segments(&group_keys, &group_values, options)
                    })
                }
            },
        );
        // Per key: the first owner's answer, unless another owner took it.
        let mut results: Vec<Option<kvtier::Result<()>>> = keys.iter().map(|_| None).collect();
        let mut by_target: BTreeMap<Target, BTreeMap<usize, kvtier::Result<()>>> = BTreeMap::new();
        for ((target, indices), answer) in answers {
            let per_key: Vec<kvtier::Result<()>> = match answer {
                Some(per_key) => per_key,
                None => indices
                    .iter()
                    .map(|_| Err(self.unreachable(target)))
                    .collect(),
            };
            by_target
                .entry(target)
                .or_default()
                .extend(indices.into_iter().zip(per_key));
        }
        for (i, targets) in owners.iter().enumerate() {
            for target in targets {
                let answer = by_target
                    .get_mut(target)
                    .and_then(|m| m.remove(&i))
                    .unwrap_or_else(|| Err(self.unreachable(*target)));
                match (&results[i], answer) {
                    (Some(Ok(())), _) => {}
                    (_, Ok(())) => results[i] = Some(Ok(())),
                    (None, Err(e)) => results[i] = Some(Err(e)),
                    (Some(Err(_)), Err(_)) => {}
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(kvtier::Error::invalid("a key with no owner"))))
            .collect()
    }

    /// Whether each key is present on any of its owners.
    /// What each key's value takes, asked of its owners in read order
    /// (a length probe, no value moved): the first owner that holds it
    /// says its length; `Absent` when every owner answered that it has
    /// none, `Unknown` when one could not say (unreachable, or a server
    /// from before length probes).
    pub fn value_lens(&self, keys: &[&[u8]]) -> Vec<KnownLen> {
        let orders: Vec<Vec<Target>> = keys.iter().map(|k| self.read_order(k)).collect();
        let mut lens = vec![KnownLen::Absent; keys.len()];
        let mut settled = vec![false; keys.len()];
        for round in 0.. {
            let groups = round_groups(&orders, &settled, round);
            if groups.is_empty() {
                break;
            }
            let answers = self.run(
                groups,
                |target, indices| {
                    let group_keys: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                    (target, group_keys)
                },
                |store_or_peer, (_, group_keys)| match store_or_peer {
                    None => {
                        let store = here(self.local);
                        Some(
                            group_keys
                                .iter()
                                .map(|k| match store.value_len(k) {
                                    Ok(Some(n)) => KnownLen::Len(n),
                                    Ok(None) => KnownLen::Absent,
                                    Err(_) => KnownLen::Unknown,
                                })
                                .collect::<Vec<_>>(),
                        )
                    }
                    Some((peers, member, namespace)) => {
                        peers.call(member, namespace, group_keys.len(), |c| {
                            c.batch_value_lens(&group_keys)
                        })
                    }
                },
            );
            for ((_, indices), answer) in answers {
                match answer {
                    Some(per_key) => {
                        for (&i, known) in indices.iter().zip(per_key) {
                            match known {
                                KnownLen::Len(_) => {
                                    lens[i] = known;
                                    settled[i] = true;
                                }
                                KnownLen::Unknown => lens[i] = KnownLen::Unknown,
                                KnownLen::Absent => {}
                            }
                        }
                    }
                    None => {
                        for &i in &indices {
                            lens[i] = KnownLen::Unknown;
                        }
                    }
                }
            }
        }
        lens
    }

    pub fn exists(&self, keys: &[&[u8]]) -> Vec<bool> {
        let orders: Vec<Vec<Target>> = keys.iter().map(|k| self.read_order(k)).collect();
        let mut present = vec![false; keys.len()];
        for round in 0.. {
            let groups = round_groups(&orders, &present, round);
            if groups.is_empty() {
                break;
            }
            let answers = self.run(
                groups,
                |target, indices| {
                    let group_keys: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                    (target, group_keys)
                },
                |store_or_peer, (_, group_keys)| match store_or_peer {
                    None => Some(here(self.local).batch_exists(&group_keys)),
                    Some((peers, member, namespace)) => {
                        peers.call(member, namespace, group_keys.len(), |c| {
                            c.batch_exists(&group_keys)
                        })
                    }
                },
            );
            for ((_, indices), answer) in answers {
                for (&i, here) in indices.iter().zip(answer.unwrap_or_default()) {
                    present[i] |= here;
                }
            }
        }
        present
    }

    /// Removes `key` from every owner; whether any of them held it. An
    /// owner that cannot be reached fails the call (its copy may remain,
    /// and a later remove takes it).
    pub fn remove(&self, key: &[u8]) -> kvtier::Result<bool> {
        let groups: Groups = self.owners(key).into_iter().map(|t| (t, vec![0])).collect();
        let answers = self.run(
            groups,
            |_, _| (),
            |store_or_peer, ()| match store_or_peer {
                None => Some(here(self.local).remove(key)),
                Some((peers, member, namespace)) => {
                    peers.call(member, namespace, 1, |c| c.remove(key)).map(Ok)
                }
            },
        );
        let mut removed = false;
        for ((target, _), answer) in answers {
            match answer {
                Some(Ok(here)) => removed |= here,
                Some(Err(e)) => return Err(e),
                None => return Err(self.unreachable(target)),
            }
        }
        Ok(removed)
    }

    /// Flushes every member: what any of them acknowledged is durable.
    /// A member that cannot be reached fails the flush.
    pub fn flush(&self) -> kvtier::Result<()> {
        self.on_every_member(|store| store.flush(), |c| c.flush())
            .map(|_| ())
    }

    /// Retires the namespace on every member (each removes what it
    /// holds); the sums of what they removed. A member that cannot be
    /// reached fails the call (what the others removed stays removed; the
    /// call may be repeated).
    pub fn retire_namespace(&self) -> kvtier::Result<kvtier::RetiredNamespace> {
        let parts = self.on_every_member(|store| store.retire(), |c| c.retire_namespace())?;
        let mut total = kvtier::RetiredNamespace::default();
        for part in parts {
            total.blocks += part.blocks;
            total.bytes += part.bytes;
            total.tombstones += part.tombstones;
        }
        Ok(total)
    }

    /// `local` on this node's store and `remote` on every other member,
    /// at once; each one's answer, or the first failure (a member that
    /// cannot be reached fails the call).
    fn on_every_member<T: Send>(
        &self,
        local: impl Fn(&NamespacedStore) -> kvtier::Result<T> + Sync,
        remote: impl Fn(&mut crate::conn::Connection) -> kvtier::Result<T> + Sync,
    ) -> kvtier::Result<Vec<T>> {
        let mut groups = Groups::new();
        groups.insert(Target::Local, Vec::new());
        for (m, member) in self.members.iter().enumerate() {
            if member.id != self.me {
                groups.insert(Target::Remote(m), Vec::new());
            }
        }
        let answers = self.run(
            groups,
            |_, _| (),
            |store_or_peer, ()| match store_or_peer {
                None => Some(local(here(self.local))),
                Some((peers, member, namespace)) => {
                    peers.call(member, namespace, 0, &remote).map(Ok)
                }
            },
        );
        let mut all = Vec::with_capacity(answers.len());
        for ((target, _), answer) in answers {
            match answer {
                Some(Ok(one)) => all.push(one),
                Some(Err(e)) => return Err(e),
                None => return Err(self.unreachable(target)),
            }
        }
        Ok(all)
    }

    fn unreachable(&self, target: Target) -> kvtier::Error {
        let name = match target {
            Target::Local => "this node".to_string(),
            Target::Remote(m) => format!(
                "cluster member {} at {}",
                self.members[m].id, self.members[m].address
            ),
        };
        kvtier::Error::io(
            format!("{name} did not answer"),
            std::io::Error::from(std::io::ErrorKind::TimedOut),
        )
    }

    /// Runs one call per target at once: this node's on the calling
    /// thread, each member's on a scoped thread. `prepare` builds a
    /// target's work from its key indices (on this thread, where the
    /// borrows are split); `call` runs it with `None` for the local store
    /// or the member to send it to. Returns each target's indices with its
    /// answer (`None`: the member could not be reached).
    fn run<W: Send, A: Send>(
        &self,
        groups: Groups,
        mut prepare: impl FnMut(Target, &[usize]) -> W,
        call: impl Fn(Option<(&Peers, &Member, &str)>, W) -> Option<A> + Sync,
    ) -> Answers<A> {
        let work: Vec<(Target, Vec<usize>, W)> = groups
            .into_iter()
            .map(|(target, indices)| {
                let w = prepare(target, &indices);
                (target, indices, w)
            })
            .collect();
        std::thread::scope(|scope| {
            let mut local = None;
            let mut handles = Vec::new();
            for (target, indices, w) in work {
                match target {
                    Target::Local => local = Some((indices, w)),
                    Target::Remote(m) => {
                        let member = &self.members[m];
                        let call = &call;
                        let (peers, namespace) = (self.peers, self.namespace);
                        handles.push((
                            (target, indices),
                            scope.spawn(move || call(Some((peers, member, namespace)), w)),
                        ));
                    }
                }
            }
            let mut answers = Vec::new();
            if let Some((indices, w)) = local {
                answers.push(((Target::Local, indices), call(None, w)));
            }
            for (key, handle) in handles {
                answers.push((key, handle.join().unwrap_or(None)));
            }
            answers
        })
    }
}
