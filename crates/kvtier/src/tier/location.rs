//! Where a tier below memory keeps a value, as the index holds it: a unit
//! of the tier (the region log's region: this log's id, or the handle of
//! another writer's region) and the value's page in it. The store keeps it
//! and hands it back to the tier; only the tier turns it into a file and
//! an offset (foyer's device `translate`).

use std::num::NonZeroU32;

/// Where a value lives in a tier: a unit (a region) and the value's offset
/// in it, in 4 KiB pages. Stored as region + 1 so that `Option<Location>`
/// costs no extra bytes in every index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    region_plus_one: NonZeroU32,
    page: u32,
}

impl Location {
    /// Region ids stop below `u32::MAX` (the region allocator refuses it).
    pub fn new(region: u32, page: u32) -> Self {
        Location {
            region_plus_one: NonZeroU32::new(region.wrapping_add(1))
                .expect("region id below u32::MAX"),
            page,
        }
    }

    pub fn region(self) -> u32 {
        self.region_plus_one.get() - 1
    }

    pub fn page(self) -> u32 {
        self.page
    }
}

#[cfg(test)]
mod tests {
    use super::Location;

    #[test]
    fn a_location_is_eight_bytes_and_free_in_an_option() {
        assert_eq!(std::mem::size_of::<Location>(), 8);
        assert_eq!(std::mem::size_of::<Option<Location>>(), 8);
        for (region, page) in [(0, 0), (7, 9), (u32::MAX - 1, u32::MAX)] {
            let loc = Location::new(region, page);
            assert_eq!((loc.region(), loc.page()), (region, page));
        }
    }
}
