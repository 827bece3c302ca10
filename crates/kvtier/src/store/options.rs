//! Per-call put options.

/// Where a put may keep its value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PutTier {
    /// The memory pool now and disk in the background (write-through).
    #[default]
    MemoryAndDisk,
    /// The memory pool only: never written to disk, dropped first under
    /// pressure, gone after a restart.
    MemoryOnly,
}

/// Per-call put options. Default: write-through, overwrite, don't wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Leave keys that are already present untouched (and report success).
    pub skip_existing: bool,
    pub tier: PutTier,
    /// Return only once the values are durable on disk.
    pub durable: bool,
}
