//! A read-only view of where a data directory's values lie, for tools
//! (`internals`): the bench replays the store's disk reads raw through it.

use super::format::{self, RegionHeader, REGION_HEADER_LEN};
use super::names::{parse_region_name, RegionName};
use super::scan::{scan_batches, BadPage, RegionReader};
use super::{DiskLocation, REGION_DIR};
use crate::error::{Error, Result};
use crate::units::PAGE_SIZE;
use std::fs::{self, File};
use std::path::Path;

/// Where each value stored in the data directory `data_dir` lies, read
/// from its region files' batch records without opening the store (so it
/// may run beside a live store or server, read-only): each qualified key's
/// newest put, unless a newer tombstone removed it. A snapshot for tools
/// that replay the store's disk reads raw (the bench's shape-matched stream
/// through a server); the store's own index stays the authority. Meant for
/// a directory one node writes (sequence numbers order one node's puts).
pub fn value_locations(
    data_dir: &Path,
) -> Result<std::collections::HashMap<Vec<u8>, DiskLocation>> {
    let secret = crate::data_dir::read_secret(data_dir)?;
    // Format 2's region names carry no node id: their records are bound to
    // the directory's own.
    let node_id = crate::data_dir::read_node_id(data_dir)?.unwrap_or_default();
    let dir = data_dir.join(REGION_DIR);
    let listing =
        fs::read_dir(&dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut newest: std::collections::HashMap<Vec<u8>, (u64, Option<DiskLocation>)> =
        std::collections::HashMap::new();
    for item in listing {
        let path = item
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
            .path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let Some(RegionName { id, .. }) = parse_region_name(&name) else {
            continue;
        };
        let file = match File::open(&path) {
            Ok(file) => file,
            // Reclaimed by the live store since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        };
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(format!("reading size of {}", path.display()), e))?
            .len();
        let mut reader = RegionReader::new(&file, file_len);
        let named = file_len >= REGION_HEADER_LEN
            && reader
                .read(0, PAGE_SIZE as usize, false)
                .is_ok_and(|page| RegionHeader::decode(page).is_ok_and(|h| h.region == id));
        if !named {
            continue;
        }
        let from = REGION_HEADER_LEN;
        scan_batches(
            &mut reader,
            &super::names::record_origin(&path, id, &node_id, true),
            &secret,
            from,
            BadPage::Resync,
            |batch_start, entries| {
                for entry in entries {
                    if newest
                        .get(&entry.key)
                        .is_some_and(|(seq, _)| *seq > entry.seq)
                    {
                        continue;
                    }
                    let location = (entry.kind == format::RecordKind::Put).then(|| DiskLocation {
                        path: path.clone(),
                        offset: batch_start + entry.value_offset,
                        len: entry.value_len,
                        digest: entry.digest,
                        checksum: entry.checksum,
                    });
                    newest.insert(entry.key, (entry.seq, location));
                }
            },
        );
    }
    Ok(newest
        .into_iter()
        .filter_map(|(key, (_, location))| Some((key, location?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, tombstone, TestLog};
    use super::super::RecoveryChecks;
    use super::*;

    #[test]
    fn the_newest_put_of_each_key_unless_a_newer_tombstone_removed_it() {
        let log = TestLog::new(64 << 10);
        // The secret the test log keys its records with, private as the
        // store writes it.
        use std::os::unix::fs::OpenOptionsExt;
        let mut secret = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(log.path().join(crate::data_dir::KEY_SECRET_FILE))
            .unwrap();
        std::io::Write::write_all(&mut secret, log.secret.as_bytes()).unwrap();
        let (tier, _, _) = log.open(RecoveryChecks::default());
        log.write(&tier, &[put(b"a", 1, 100, 1), put(b"b", 2, 100, 2)])
            .unwrap();
        let newer_a = log.write(&tier, &[put(b"a", 3, 40 << 10, 3)]).unwrap()[0];
        log.write(&tier, &[tombstone(b"b", 4), put(b"c", 5, 10, 5)])
            .unwrap();
        let found = value_locations(log.path()).unwrap();
        let mut keys: Vec<_> = found.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, vec![b"\0a".to_vec(), b"\0c".to_vec()]);
        let a = &found[&b"\0a".to_vec()];
        assert_eq!(a.len, 40 << 10);
        assert_eq!(a.offset, u64::from(newer_a.page()) * PAGE_SIZE);
        assert_eq!(a.path, tier.region(newer_a.region()).unwrap().path());
    }
}
