//! Every batch record the tier reads from, for the namespace census and
//! retirement (`store::namespaces`): this log's regions whole, and other
//! writers' regions of a shared directory up to where they were followed
//! (what the index may hold of them). Read through the one scanner, every
//! record verified, so a key handed over is one the directory's secret
//! made.

use super::format::{RecordEntry, REGION_HEADER_LEN};
use super::scan::{scan_batches, value_loc, BadPage, RegionReader};
use super::{DiskLoc, DiskTier, Region};
use std::sync::Arc;

/// A region file to read records from: the region the index names, the
/// id its records carry (another writer's own id, not the handle), and
/// how far to read.
struct RecordSource {
    region: Arc<Region>,
    file_id: u32,
    until: u64,
    other_writers: bool,
}

impl DiskTier {
    /// Hands every entry of every verified record to `visit`, with the
    /// index location of a put's value (`None` for a tombstone, or a put
    /// no location can name). Regions reclaimed meanwhile are read from
    /// the descriptor held (their entries are gone from the index, so
    /// they match nothing there). Reads are plain `pread`s of the records
    /// only (about one page per batch), not bounded by the storage
    /// deadline: a stalled file system holds the caller, an operator's
    /// command, until it answers.
    pub(crate) fn visit_records(&self, mut visit: impl FnMut(Option<DiskLoc>, RecordEntry)) {
        for source in self.record_sources() {
            let mut reader = RegionReader::new(&source.region.file, source.until);
            let (index_id, file_id) = (source.region.id, source.file_id);
            let origin = if source.other_writers {
                super::names::record_origin(source.region.path(), file_id, "", false)
            } else {
                self.own_origin(source.region.path(), file_id)
            };
            scan_batches(
                &mut reader,
                &origin,
                &self.secret,
                REGION_HEADER_LEN,
                BadPage::Resync,
                |batch_start, entries| {
                    for entry in entries {
                        let loc = (entry.kind == super::format::RecordKind::Put)
                            .then(|| value_loc(index_id, batch_start, &entry))
                            .flatten();
                        visit(loc, entry);
                    }
                },
            );
            if source.other_writers {
                // What was read of another writer's buffered file may be
                // kept by the page cache: never let it serve a later scan
                // or value read (see `others::scan_new_batches`).
                super::mount::drop_cached(
                    &source.region.file,
                    REGION_HEADER_LEN,
                    source.until.saturating_sub(REGION_HEADER_LEN),
                );
            }
        }
    }

    fn record_sources(&self) -> Vec<RecordSource> {
        let mut sources: Vec<RecordSource> = self
            .regions
            .read()
            .unwrap()
            .values()
            .map(|region| RecordSource {
                region: Arc::clone(region),
                file_id: region.id,
                until: region.len(),
                other_writers: false,
            })
            .collect();
        let followed = self.followed_regions();
        let others = self.others.read().unwrap();
        for (handle, file_id, until) in followed {
            if let Some(region) = others.get(&handle) {
                sources.push(RecordSource {
                    region: Arc::clone(region),
                    file_id,
                    until: until.min(region.len()),
                    other_writers: true,
                });
            }
        }
        sources
    }
}
