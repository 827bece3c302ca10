//! What recovery saw: counts for logs, tests and the store's stats,
//! filled by recovery and by opening a log as an index checkpoint recorded
//! it (a leaf both write into, so neither names the other).

/// What recovery saw, for logs and tests.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub regions: u64,
    /// Batches whose records verified (and were applied, unless behind a
    /// missing region or dropped by the tail scrub).
    pub batches: u64,
    pub records: u64,
    /// Regions with pages where no valid batch starts (a torn tail after a
    /// failed write, or damage), and how many such pages recovery skipped.
    pub damaged_regions: u64,
    pub skipped_pages: u64,
    /// Region files moved to `quarantine/` because their header could not
    /// be read or verified (kept for inspection, never deleted).
    pub quarantined_regions: u64,
    /// Empty region files removed (created, but their header never
    /// written: they can hold nothing).
    pub empty_regions_removed: u64,
    /// Highest sequence number seen in any header or record.
    pub max_seq: u64,
    /// Regions whose header was damaged but whose batches verified on
    /// their own (kept: the header holds nothing the batches need).
    pub damaged_headers: u64,
    /// Regions whose records were intact but keyed with another secret
    /// (quarantined, never reclaimed as if they were this store's).
    pub foreign_regions: u64,
    /// Files under a region name that recovery could neither use nor
    /// quarantine (left in place, not indexed).
    pub skipped_files: u64,
    /// Regions read without O_DIRECT because their file refused it.
    pub buffered_regions: u64,
    /// Regions older than a missing one (a gap in the region ids, or a
    /// newest region the log head names but the directory lacks), and
    /// their record entries, which were not indexed: the missing region
    /// may have held the tombstones that removed them.
    pub regions_behind_gap: u64,
    pub entries_behind_gap: u64,
    /// The tail scrub after an unclean shutdown: values of the newest
    /// region checked before indexing, those that did not verify, and the
    /// milliseconds it took.
    pub scrubbed_entries: u64,
    pub scrub_dropped: u64,
    pub scrub_ms: u64,
    /// The regions were opened as an index checkpoint recorded them, and
    /// no record was read (`RecoveryChecks::recorded`); the store then
    /// indexes the checkpoint's entries, counted here.
    pub from_checkpoint: bool,
    pub checkpoint_entries: u64,
}
