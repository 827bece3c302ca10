//! A node's incarnation: it changes at every start and every lost lease.
//! (The node id is the data directory's: `kvtier::Store::node_id`.)

use std::time::{SystemTime, UNIX_EPOCH};

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
    fn incarnations_increase() {
        let (x, y) = (new_incarnation(), new_incarnation());
        assert!(y >= x && x > 0);
    }
}
