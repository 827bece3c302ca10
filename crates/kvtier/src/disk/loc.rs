//! The disk tier's address of a value, as the index holds it: a region
//! (this log's id, or the handle of another writer's region) and the
//! value's page. The disk's own type: the index stores it, the disk tier
//! alone turns it into a file and an offset.

use std::num::NonZeroU32;

/// Where a value lives in the disk tier: a region and the value's offset
/// in it, in 4 KiB pages. Stored as region + 1 so that `Option<DiskLoc>`
/// costs no extra bytes in every index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLoc {
    region_plus_one: NonZeroU32,
    page: u32,
}

impl DiskLoc {
    /// Region ids stop below `u32::MAX` (the region allocator refuses it).
    pub fn new(region: u32, page: u32) -> Self {
        DiskLoc {
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
    use super::DiskLoc;

    #[test]
    fn a_location_is_eight_bytes_and_free_in_an_option() {
        assert_eq!(std::mem::size_of::<DiskLoc>(), 8);
        assert_eq!(std::mem::size_of::<Option<DiskLoc>>(), 8);
        for (region, page) in [(0, 0), (7, 9), (u32::MAX - 1, u32::MAX)] {
            let loc = DiskLoc::new(region, page);
            assert_eq!((loc.region(), loc.page()), (region, page));
        }
    }
}
