//! Namespaces as an operator sees them (docs/design.md, "Namespaces: census,
//! manifests, retirement"): which namespaces hold blocks and how many bytes
//! (a census of the index, read beside the log's batch records, which name
//! every key), each one's manifest (what an integration says its digest
//! stands for), and the retirement of a whole namespace in one call.
//!
//! The index keeps digests only (keyed hashes of namespace and key), so a
//! namespace's blocks are found through what does name them: the batch
//! records of every region the tier reads (this log's, and other writers'
//! as far as they were followed), and, for values that no record names
//! (memory-only puts), the pool slot, which keeps its namespace.

use super::{Inner, NamespacedStore, PutOptions};
use crate::error::Result;
use crate::events::{BlockEvent, Medium};
use crate::key::{KeyDigest, Namespace};
use crate::stats::Counters;
use crate::tier::RecordKind;
use crate::write_log::QueuedWrite;
use std::collections::HashMap;
use std::sync::Arc;

pub use crate::key::{MANIFEST_KEY, MAX_MANIFEST_LEN};

/// Tombstones queued before the retirement waits for them to be durable:
/// bounds the keys held in the write queue at once.
const RETIRE_CHUNK: usize = 4096;

/// One namespace as the census found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceCensus {
    /// The namespace's name (`""` is the default namespace).
    pub name: String,
    /// Blocks the index holds in it (its manifest not counted).
    pub blocks: u64,
    /// Their bytes (values' lengths).
    pub bytes: u64,
    /// Of `blocks`, those held in memory only (memory-only puts; the
    /// census flushes queued puts first).
    pub memory_only_blocks: u64,
    /// Its manifest as stored (see [`NamespacedStore::describe`]), if one
    /// is held and reads back verified.
    ///
    /// [`NamespacedStore::describe`]: crate::NamespacedStore::describe
    pub manifest: Option<Vec<u8>>,
}

/// What retiring a namespace removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetiredNamespace {
    /// Blocks the index held in it and no longer does (its manifest
    /// included).
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Tombstones written: one per key any record names in it whose
    /// newest record is a put or that the index held.
    pub tombstones: u64,
}

#[derive(Debug, Default)]
struct Tally {
    blocks: u64,
    bytes: u64,
    memory_only_blocks: u64,
    has_manifest: bool,
}

impl Inner {
    /// Every namespace holding a block (or a manifest), sorted by name.
    pub(super) fn namespace_census(self: &Arc<Self>) -> Result<Vec<NamespaceCensus>> {
        self.check_open()?;
        // Queued puts are written first, so that `memory_only_blocks`
        // counts what memory alone holds by choice (memory-only puts), not
        // what the flusher had not reached yet.
        self.flush_all()?;
        let mut tallies: HashMap<Vec<u8>, Tally> = HashMap::new();
        if let Some(lower) = &self.lower {
            Arc::clone(lower).visit_records(&mut |loc, entry| {
                let Some(loc) = loc else { return };
                // Live: the index entry is this record's (same place, same
                // number), not an older or newer put of the key.
                let live = self
                    .index
                    .lock(entry.digest)
                    .get(entry.digest)
                    .is_some_and(|e| e.disk() == Some(loc) && e.seq() == entry.seq);
                let Some((name, key)) = crate::key::split_qualified(&entry.key) else {
                    return;
                };
                if !live {
                    return;
                }
                let prefix = &entry.key[..1 + name.len()];
                let tally = tally_of(&mut tallies, prefix);
                if key == MANIFEST_KEY {
                    tally.has_manifest = true;
                } else {
                    tally.blocks += 1;
                    tally.bytes += u64::from(entry.value_len);
                }
            })?;
        }
        for (digest, prefix, len) in self.memory_only_entries(None) {
            let tally = tally_of(&mut tallies, &prefix);
            if digest == self.manifest_digest(&prefix) {
                tally.has_manifest = true;
            } else {
                tally.blocks += 1;
                tally.bytes += u64::from(len);
                tally.memory_only_blocks += 1;
            }
        }
        let mut census = Vec::with_capacity(tallies.len());
        for (prefix, tally) in tallies {
            let name = String::from_utf8_lossy(&prefix[1..]).into_owned();
            let manifest = if tally.has_manifest {
                self.read_manifest(&name)?
            } else {
                None
            };
            census.push(NamespaceCensus {
                name,
                blocks: tally.blocks,
                bytes: tally.bytes,
                memory_only_blocks: tally.memory_only_blocks,
                manifest,
            });
        }
        census.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(census)
    }

    /// Removes every block of `ns` (its manifest too), durable on return,
    /// with a `Removed` event for each block the index held. Puts into
    /// `ns` that race with the call may survive it (they are acknowledged
    /// after its scan); everything put before the call is gone.
    pub(super) fn retire_namespace(&self, ns: &Namespace) -> Result<RetiredNamespace> {
        self.check_open()?;
        // Queued write-through puts are written first, so that a record
        // names each of their keys (a key no record names gets no
        // tombstone, and its put, written later, would come back).
        self.flush_all()?;
        let prefix = ns.prefix_shared();
        let manifest = self.manifest_digest(&prefix);
        // Per key of the namespace any record names: its newest record.
        let mut newest: HashMap<u128, (u64, bool, Box<[u8]>)> = HashMap::new();
        if let Some(lower) = &self.lower {
            Arc::clone(lower).visit_records(&mut |_, entry| {
                if !entry.key.starts_with(&prefix) {
                    return;
                }
                let put = entry.kind == RecordKind::Put;
                match newest.get_mut(&entry.digest.0) {
                    Some(seen) if seen.0 >= entry.seq => {}
                    Some(seen) => *seen = (entry.seq, put, entry.key.into_boxed_slice()),
                    None => {
                        newest.insert(entry.digest.0, (entry.seq, put, entry.key.into()));
                    }
                }
            })?;
        }
        let doomed: Vec<(KeyDigest, Box<[u8]>)> = newest
            .into_iter()
            .filter(|(digest, (_, put, _))| {
                *put || self
                    .index
                    .lock(KeyDigest(*digest))
                    .get(KeyDigest(*digest))
                    .is_some()
            })
            .map(|(digest, (_, _, key))| (KeyDigest(digest), key))
            .collect();
        let mut retired = RetiredNamespace::default();
        for chunk in doomed.chunks(RETIRE_CHUNK) {
            let mut removed = Vec::new();
            let mut seqs = (u64::MAX, 0);
            for (digest, key) in chunk {
                let digest = *digest;
                let seq = self.log.append(|seq| {
                    let mut shard = self.index.lock(digest);
                    if let Some(entry) = shard.remove(digest) {
                        let medium = if entry.disk().is_some() {
                            Medium::Storage
                        } else {
                            Medium::Memory
                        };
                        removed.push((digest, medium, entry.value_len()));
                    }
                    if let Some(follower) = &self.follower {
                        // As for one remove: another writer's older put of
                        // the key, read from now on, is not indexed.
                        follower.note_removal(digest, seq);
                    }
                    drop(shard);
                    self.writes_below.then(|| QueuedWrite::Tombstone {
                        digest,
                        key: key.clone(),
                        seq,
                    })
                })?;
                seqs = (seqs.0.min(seq), seqs.1.max(seq));
            }
            retired.tombstones += chunk.len() as u64;
            if self.writes_below && !chunk.is_empty() {
                self.wait_durable(seqs.0, seqs.1)?;
            }
            // After the removals are durable: announced, they hold.
            self.announce_removed(&removed, manifest, &mut retired);
        }
        // Values no record names: memory-only puts (a store without a
        // disk tier holds only these). Nothing on disk can bring them
        // back, so dropping them from the index is the whole removal.
        let mut removed = Vec::new();
        for (digest, _, _) in self.memory_only_entries(Some(&prefix)) {
            let mut shard = self.index.lock(digest);
            let still = shard.get(digest).is_some_and(|e| {
                e.disk().is_none() && e.mem().is_some_and(|s| s.namespace_prefix() == &prefix[..])
            });
            if still {
                if let Some(entry) = shard.remove(digest) {
                    removed.push((digest, Medium::Memory, entry.value_len()));
                }
            }
        }
        self.announce_removed(&removed, manifest, &mut retired);
        tracing::info!(
            namespace = ns.name(),
            blocks = retired.blocks,
            bytes = retired.bytes,
            tombstones = retired.tombstones,
            "retired a namespace: every block put in it before the call is removed, durably"
        );
        Ok(retired)
    }

    fn announce_removed(
        &self,
        removed: &[(KeyDigest, Medium, u32)],
        manifest: KeyDigest,
        retired: &mut RetiredNamespace,
    ) {
        for &(digest, medium, len) in removed {
            retired.blocks += 1;
            retired.bytes += u64::from(len);
            // The manifest was never announced: it is not a KV block.
            if digest != manifest {
                self.emit(|| BlockEvent::Removed { medium, digest });
            }
        }
        Counters::add(&self.counters.removes, removed.len() as u64);
    }

    /// Index entries with a memory copy and no disk location (in the
    /// namespace with qualified-key prefix `only`, or in any): digest,
    /// namespace prefix, length.
    fn memory_only_entries(&self, only: Option<&[u8]>) -> Vec<(KeyDigest, Vec<u8>, u32)> {
        let mut found = Vec::new();
        self.index.visit_by_shard(
            |digest, entry| {
                if entry.disk().is_some() {
                    return None;
                }
                let slot = entry.mem()?;
                let prefix = slot.namespace_prefix();
                if only.is_some_and(|only| only != prefix) {
                    return None;
                }
                Some((digest, prefix.to_vec(), entry.value_len()))
            },
            |picked| found.extend(picked),
        );
        found
    }

    /// The digest of the manifest key in the namespace with qualified-key
    /// prefix `prefix`.
    fn manifest_digest(&self, prefix: &[u8]) -> KeyDigest {
        let mut qualified = prefix.to_vec();
        qualified.extend_from_slice(MANIFEST_KEY);
        self.secret.digest_qualified(&qualified)
    }

    /// The manifest stored in namespace `name`, read and verified as any
    /// value is; `None` if there is none (or it is not a namespace name).
    /// Read with a fixed capacity: a value under the manifest key longer
    /// than `MAX_MANIFEST_LEN` (written before puts of it were bounded) is
    /// not read at all, so a census costs at most that much per namespace.
    fn read_manifest(self: &Arc<Self>, name: &str) -> Result<Option<Vec<u8>>> {
        let Ok(ns) = Namespace::new(Arc::clone(&self.secret), name) else {
            return Ok(None);
        };
        let namespaced = NamespacedStore::new(Arc::clone(self), ns);
        if namespaced
            .value_len(MANIFEST_KEY)?
            .is_some_and(|len| len > MAX_MANIFEST_LEN)
        {
            tracing::warn!(
                namespace = name,
                "a value under the manifest key is longer than a manifest may be: not read"
            );
            return Ok(None);
        }
        namespaced.get(MANIFEST_KEY)
    }
}

impl NamespacedStore {
    /// Stores this namespace's manifest: what its name's digest stands
    /// for, in words an operator reads (the engine integrations store the
    /// fields they hashed, as JSON; the store keeps the bytes as given).
    /// Kept under [`MANIFEST_KEY`](crate::MANIFEST_KEY) in the namespace,
    /// durable on return, listed by [`Store::namespaces`](crate::Store::namespaces),
    /// removed with the namespace. At most
    /// [`MAX_MANIFEST_LEN`](crate::MAX_MANIFEST_LEN) bytes.
    pub fn describe(&self, manifest: &[u8]) -> Result<()> {
        crate::key::validate_manifest(manifest)?;
        self.put_with(
            MANIFEST_KEY,
            manifest,
            &PutOptions {
                durable: true,
                ..PutOptions::default()
            },
        )
    }

    /// This namespace's manifest, if one is stored (see [`Self::describe`]).
    pub fn manifest(&self) -> Result<Option<Vec<u8>>> {
        self.get(MANIFEST_KEY)
    }

    /// Removes every block of this namespace, its manifest included: one
    /// tombstone per key, durable on return, a `Removed` event per block
    /// (docs/design.md, "Namespaces: census, manifests, retirement").
    /// Everything put in the namespace before the call is gone for good,
    /// after any restart and on every node of a shared directory; puts
    /// racing with the call may survive it.
    pub fn retire(&self) -> Result<RetiredNamespace> {
        self.inner().retire_namespace(self.namespace())
    }
}

fn tally_of<'t>(tallies: &'t mut HashMap<Vec<u8>, Tally>, prefix: &[u8]) -> &'t mut Tally {
    if !tallies.contains_key(prefix) {
        tallies.insert(prefix.to_vec(), Tally::default());
    }
    tallies.get_mut(prefix).expect("inserted above")
}

#[cfg(test)]
mod tests {
    use crate::{Config, Store};
    use std::time::{Duration, Instant};

    /// A record scan held back (the test gate standing for a file system
    /// that stopped answering) fails the census and a retirement with an
    /// error that names the deadline, changes nothing, parks one thread
    /// at most, and once it ends both work again.
    #[test]
    fn record_scans_past_the_storage_deadline_fail_census_and_retirement_and_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            Config::new(dir.path())
                .memory_capacity(8 << 20)
                .disk_capacity(64 << 20)
                // The default: the retirement and census after the gate opens
                // must not miss it on a busy machine.
                .io_deadline(Duration::from_secs(5)),
        )
        .unwrap();
        let view = store.in_namespace(&store.namespace("stalled").unwrap());
        view.put(b"block", b"bytes").unwrap();
        store.flush().unwrap();
        let disk = store.inner.disk_for_tests.clone().expect("a disk tier");
        let close = |closed: bool| {
            let (gate, opened) = &*disk.scan_gate;
            *gate.lock().unwrap() = closed;
            opened.notify_all();
        };
        close(true);
        let e = store.namespaces().unwrap_err();
        assert!(e.to_string().contains("storage deadline"), "{e}");
        assert_eq!(disk.scans_held(), 1);
        // While that scan is parked, the next fails at once, parking none.
        let e = view.retire().unwrap_err();
        assert!(e.to_string().contains("still waiting"), "{e}");
        assert_eq!(disk.scans_held(), 1);
        assert_eq!(view.get(b"block").unwrap().as_deref(), Some(&b"bytes"[..]));
        close(false);
        let until = Instant::now() + Duration::from_secs(60);
        while disk.scans_held() > 0 {
            assert!(Instant::now() < until, "the parked scan never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
        let census = store.namespaces().unwrap();
        let stalled = census.iter().find(|c| c.name == "stalled").unwrap();
        assert_eq!(stalled.blocks, 1);
        assert_eq!(view.retire().unwrap().blocks, 1);
        assert_eq!(view.get(b"block").unwrap(), None);
    }
}
