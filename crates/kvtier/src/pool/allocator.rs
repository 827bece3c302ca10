//! Best-fit extent allocator over the pool's pages, with immediate
//! coalescing of neighbouring free extents.
//!
//! Free space is tracked twice: by offset (to find neighbours when freeing)
//! and by (length, offset) (to find the smallest extent that fits). Both
//! operations are O(log n) in the number of free extents. Fragmentation is
//! bounded in practice because the store evicts when an allocation fails,
//! and freeing every allocation always coalesces back to one extent.

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug)]
pub struct ExtentAllocator {
    total_pages: u64,
    free_pages: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl ExtentAllocator {
    pub fn new(total_pages: u64) -> Self {
        let mut allocator = ExtentAllocator {
            total_pages,
            free_pages: 0,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if total_pages > 0 {
            allocator.insert_free(0, total_pages);
        }
        allocator
    }

    pub fn free_pages(&self) -> u64 {
        self.free_pages
    }

    #[cfg(test)]
    /// The longest run that an allocation could get right now.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Allocates `pages` contiguous pages; returns the first page's index.
    pub fn allocate(&mut self, pages: u64) -> Option<u64> {
        debug_assert!(pages > 0);
        let &(len, offset) = self.by_size.range((pages, 0)..).next()?;
        self.remove_free(offset, len);
        if len > pages {
            self.insert_free(offset + pages, len - pages);
        }
        Some(offset)
    }

    /// Returns an extent obtained from [`allocate`](Self::allocate).
    pub fn free(&mut self, offset: u64, pages: u64) {
        debug_assert!(offset + pages <= self.total_pages);
        let mut start = offset;
        let mut len = pages;
        if let Some((&prev_offset, &prev_len)) = self.by_offset.range(..offset).next_back() {
            debug_assert!(prev_offset + prev_len <= offset, "double free");
            if prev_offset + prev_len == offset {
                self.remove_free(prev_offset, prev_len);
                start = prev_offset;
                len += prev_len;
            }
        }
        if let Some((&next_offset, &next_len)) = self.by_offset.range(offset..).next() {
            debug_assert!(offset + pages <= next_offset, "double free");
            if offset + pages == next_offset {
                self.remove_free(next_offset, next_len);
                len += next_len;
            }
        }
        self.insert_free(start, len);
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_pages += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_pages -= len;
    }

    /// Free extents by offset, for tests.
    #[cfg(test)]
    pub fn free_extents(&self) -> Vec<(u64, u64)> {
        self.by_offset.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..40).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 512 }))]
        /// Allocations never overlap, stay in bounds, free extents are
        /// coalesced, and freeing everything restores one extent.
        #[test]
        fn allocations_are_disjoint_and_coalesce(ops in proptest::collection::vec(op(), 1..200)) {
            let total = 256;
            let mut allocator = ExtentAllocator::new(total);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(pages) => {
                        let fits = allocator.largest_free() >= pages;
                        match allocator.allocate(pages) {
                            Some(offset) => {
                                prop_assert!(fits);
                                prop_assert!(offset + pages <= total);
                                for &(o, l) in &live {
                                    prop_assert!(offset + pages <= o || o + l <= offset, "overlap");
                                }
                                live.push((offset, pages));
                            }
                            None => prop_assert!(!fits),
                        }
                    }
                    Op::Free(i) => {
                        if !live.is_empty() {
                            let (o, l) = live.swap_remove(i % live.len());
                            allocator.free(o, l);
                        }
                    }
                }
                let used: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(allocator.free_pages() + used, total);
                let extents = allocator.free_extents();
                for pair in extents.windows(2) {
                    prop_assert!(pair[0].0 + pair[0].1 < pair[1].0, "adjacent free extents not merged");
                }
            }
            for (o, l) in live.drain(..) {
                allocator.free(o, l);
            }
            prop_assert_eq!(allocator.free_extents(), vec![(0, total)]);
        }
    }

    #[test]
    fn best_fit_prefers_the_smallest_hole() {
        let mut allocator = ExtentAllocator::new(100);
        let a = allocator.allocate(10).unwrap();
        let _b = allocator.allocate(5).unwrap();
        let c = allocator.allocate(3).unwrap();
        let _d = allocator.allocate(50).unwrap();
        allocator.free(a, 10);
        allocator.free(c, 3);
        // Holes: 10 pages at 0, 3 pages at 15, 32 pages at the end.
        assert_eq!(allocator.allocate(3), Some(15));
        assert_eq!(allocator.allocate(10), Some(0));
        assert_eq!(allocator.allocate(33), None);
        assert_eq!(allocator.allocate(32), Some(68));
    }
}
