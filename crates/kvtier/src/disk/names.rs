//! The log's file names: region files (`<node id>-<incarnation>-<region>.kvr`,
//! or format 2's `<region>.kvr`) and the log head, the file naming the
//! newest region created (docs/design.md, "Log head").

use super::format::RecordOrigin;
use super::{sync_dir, DiskTier};
use std::fs;
use std::path::{Path, PathBuf};

const REGION_SUFFIX: &str = ".kvr";
/// The newest region id the log has created, beside `regions/`: lets
/// recovery notice newest region files that went missing (their
/// tombstones with them). See docs/design.md, "Log head".
pub(crate) const HEAD_FILE: &str = "log-head";

/// A region file name, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RegionName<'a> {
    pub id: u32,
    /// `None` for format 2's names (the region id alone).
    pub node: Option<&'a str>,
    /// The open that created the file (0 for format 2's names).
    pub incarnation: u64,
}

/// `<node id>-<incarnation>-<region>.kvr` (32, 16 and 8 lower-case hex
/// digits), or format 2's `<region>.kvr`.
pub(crate) fn parse_region_name(name: &str) -> Option<RegionName<'_>> {
    let stem = name.strip_suffix(REGION_SUFFIX)?;
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let parts: Vec<&str> = stem.split('-').collect();
    match parts[..] {
        [region] if hex(region, 8) => Some(RegionName {
            id: u32::from_str_radix(region, 16).ok()?,
            node: None,
            incarnation: 0,
        }),
        [node, incarnation, region] if hex(node, 32) && hex(incarnation, 16) && hex(region, 8) => {
            Some(RegionName {
                id: u32::from_str_radix(region, 16).ok()?,
                node: Some(node),
                incarnation: u64::from_str_radix(incarnation, 16).ok()?,
            })
        }
        _ => None,
    }
}

/// What a record in the region file at `path` (region `region`) must be
/// bound to: the writer and open its name gives, or, for format 2's names
/// (and names that do not parse), `own_node` and incarnation 0.
pub fn record_origin(
    path: &Path,
    region: u32,
    own_node: &str,
    accept_unbound: bool,
) -> RecordOrigin {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let parsed = parse_region_name(&name);
    let node = parsed.as_ref().and_then(|p| p.node).unwrap_or(own_node);
    RecordOrigin {
        // A node id that is not 32 hex digits binds to zeros: nothing this
        // build writes is bound so, so nothing there verifies.
        writer: RecordOrigin::node_bytes(node).unwrap_or([0; 16]),
        incarnation: parsed.map_or(0, |p| p.incarnation),
        region,
        accept_unbound,
    }
}

/// The log head file's text: a line naming the newest region created, and
/// a checksum of that line (docs/design.md, "Log head").
fn format_head(id: u32) -> String {
    let line = format!("kvtier log head {id:08x}");
    format!("{line} {:016x}\n", crate::key::xxh3_64(line.as_bytes()))
}

pub(super) fn parse_head(text: &str) -> Option<u32> {
    let text = text.strip_suffix('\n')?;
    let (line, sum) = text.rsplit_once(' ')?;
    if u64::from_str_radix(sum, 16).ok()? != crate::key::xxh3_64(line.as_bytes()) {
        return None;
    }
    let id = line.strip_prefix("kvtier log head ")?;
    (id.len() == 8).then(|| u32::from_str_radix(id, 16).ok())?
}

impl DiskTier {
    /// What the records of this log's region file at `path` are bound to
    /// (`record_origin`). Version-2 records, which bind nothing, are read
    /// only in a data directory: a shared directory is written by others.
    pub(super) fn own_origin(&self, path: &Path, region: u32) -> RecordOrigin {
        record_origin(
            path,
            region,
            &self.node_id,
            self.max_region_id >= super::OTHERS_BASE,
        )
    }

    /// A new region file's path: `<node id>-<incarnation>-<region>.kvr`.
    pub(super) fn region_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!(
            "{}-{:016x}-{id:08x}{REGION_SUFFIX}",
            self.node_id, self.incarnation
        ))
    }

    /// The id of the newest region the log has created, if the head file
    /// is there and whole (directories written before it have none).
    pub(super) fn read_head(&self) -> Option<u32> {
        let path = self.head_path();
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the log head; missing newest regions will not be noticed");
                return None;
            }
        };
        match parse_head(&text) {
            Some(id) => Some(id),
            None => {
                tracing::warn!(path = %path.display(), "the log head file is damaged; missing newest regions will not be noticed");
                None
            }
        }
    }

    fn head_path(&self) -> PathBuf {
        self.dir.parent().unwrap_or(&self.dir).join(HEAD_FILE)
    }

    /// Records `id` as the newest region created: through a synced
    /// temporary file and a rename, so the file is always whole.
    pub(super) fn write_head(&self, id: u32) -> std::io::Result<()> {
        let data_dir = self.dir.parent().unwrap_or(&self.dir);
        crate::data_dir::replace_file(data_dir, HEAD_FILE, format_head(id).as_bytes(), 0o600)?;
        sync_dir(data_dir)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{TestLog, NODE};
    use super::super::RecoveryChecks;
    use super::*;

    #[test]
    fn region_names_parse_in_both_formats_and_nothing_else() {
        let name = format!("{NODE}-00000000000000ff-0000002a.kvr");
        assert_eq!(
            parse_region_name(&name),
            Some(RegionName {
                id: 42,
                node: Some(NODE),
                incarnation: 255,
            })
        );
        assert_eq!(
            parse_region_name("0000002a.kvr"),
            Some(RegionName {
                id: 42,
                node: None,
                incarnation: 0,
            })
        );
        for bad in [
            "0000002A.kvr",
            "2a.kvr",
            "0000002a.kvr.tmp",
            "0000002a",
            "-0000002a.kvr",
            "x-00000000000000ff-0000002a.kvr",
            &format!("{NODE}-ff-0000002a.kvr"),
            &format!("{NODE}-00000000000000ff-0000002a-1.kvr"),
            "+000002a.kvr",
        ] {
            assert_eq!(parse_region_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_new_region_file_is_named_by_node_incarnation_and_id() {
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let path = tier.region_path(7);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let parsed = parse_region_name(&name).unwrap();
        assert_eq!((parsed.id, parsed.node), (7, Some(NODE)));
        assert_eq!(parsed.incarnation, tier.incarnation());
    }

    #[test]
    fn the_log_head_round_trips_and_a_damaged_one_reads_as_none() {
        for id in [0, 1, 0x1234_5678, u32::MAX - 1] {
            assert_eq!(parse_head(&format_head(id)), Some(id));
        }
        let good = format_head(5);
        let damaged = [
            good.replace("00000005", "00000006"),
            good.trim_end().to_string(),
            good.replace("head", "heap"),
            format!("{good}\n"),
            String::new(),
            "kvtier log head 00000005\n".to_string(),
        ];
        for text in damaged {
            assert_eq!(parse_head(&text), None, "{text:?}");
        }
        // Written and read through the directory.
        let log = TestLog::new(1 << 20);
        let (tier, _, _) = log.open(RecoveryChecks::default());
        assert_eq!(tier.read_head(), None);
        tier.write_head(9).unwrap();
        assert_eq!(tier.read_head(), Some(9));
        std::fs::write(log.path().join(HEAD_FILE), "junk").unwrap();
        assert_eq!(tier.read_head(), None);
    }
}
