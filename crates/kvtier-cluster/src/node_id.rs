//! A node's identity: an id stable across restarts of its data directory,
//! and an incarnation that changes at every start and every lost lease.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// File in the data directory holding the node id.
const NODE_ID_FILE: &str = "node-id";

/// The id of the node serving `data_dir`: read from `<data_dir>/node-id`,
/// or made (128 random bits, hex) and written durably on first use.
pub fn node_id(data_dir: &Path) -> std::io::Result<String> {
    let path = data_dir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(id.to_string());
            }
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} does not hold a node id (32 hex digits): restore it, or remove it to join as a new node",
                    path.display()
                ),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut random = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut random)?;
    let id: String = random.iter().map(|b| format!("{b:02x}")).collect();
    // Written whole or not at all: a temporary file, synced, renamed, and
    // the directory synced.
    std::fs::create_dir_all(data_dir)?;
    let temporary = data_dir.join(format!("{NODE_ID_FILE}.tmp"));
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(format!("{id}\n").as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&temporary, &path)?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(id)
}

/// A fresh incarnation: nanoseconds since the Unix epoch, so a later
/// incarnation of a node compares greater than an earlier one.
pub fn new_incarnation() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_stable_per_directory_and_damage_is_refused() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let first = node_id(a.path()).unwrap();
        assert_eq!(node_id(a.path()).unwrap(), first);
        assert_ne!(node_id(b.path()).unwrap(), first);
        assert_eq!(first.len(), 32);
        std::fs::write(a.path().join(NODE_ID_FILE), "not an id").unwrap();
        let error = node_id(a.path()).unwrap_err().to_string();
        assert!(error.contains("does not hold a node id"), "{error}");
        let (x, y) = (new_incarnation(), new_incarnation());
        assert!(y >= x && x > 0);
    }
}
