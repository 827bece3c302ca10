//! The one round scheduler every bench mode runs its sides on. A case's
//! work is cut into rounds; in every round each side (the store, the device
//! ceiling, the shape-matched stream, memcpy, a TCP stream) moves the same
//! share of the case, and the order of the sides rotates so that each goes
//! first, second, ... equally often: drift in the device's or the host's
//! speed (a cache below the VM warming, a neighbour's burst) favours none.
//! A side is a closure that runs one round and adds its timing to its own
//! measurement; the scheduler owns only the order.

use crate::measure::BenchResult;
use std::ops::Range;

/// One round: its position and the batches it covers.
#[derive(Debug, Clone)]
pub struct Round {
    pub index: usize,
    pub batches: Range<u64>,
}

/// A side: runs `round` given what `prepare` made for it.
pub type Side<'a, P> = &'a mut dyn FnMut(&Round, &P) -> BenchResult<()>;

/// The order of `n` sides in round `r` when each order is held for `hold`
/// rounds: a rotation, so over `n * hold` rounds every side takes every
/// place equally often.
pub fn order(r: usize, hold: usize, n: usize) -> impl Iterator<Item = usize> {
    let start = (r / hold.max(1)) % n.max(1);
    (0..n).map(move |i| (start + i) % n)
}

/// Runs every side on every round of `rounds`, in rotating order. Before
/// the sides, `prepare` makes what the round's sides share (values laid
/// out before any timing, say), outside every side's timing.
pub fn run_rounds<P>(
    rounds: Vec<Range<u64>>,
    hold: usize,
    mut prepare: impl FnMut(&Round) -> BenchResult<P>,
    sides: &mut [Side<'_, P>],
) -> BenchResult<()> {
    for (index, batches) in rounds.into_iter().enumerate() {
        let round = Round { index, batches };
        let prepared = prepare(&round)?;
        for side in order(index, hold, sides.len()) {
            (sides[side])(&round, &prepared)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_side_takes_every_place_equally_often() {
        for (n, hold) in [(2, 1), (3, 1), (3, 2), (4, 3)] {
            let mut places = vec![vec![0; n]; n];
            for r in 0..n * hold * 5 {
                for (place, side) in order(r, hold, n).enumerate() {
                    places[side][place] += 1;
                }
            }
            for side in &places {
                assert!(
                    side.iter().all(|&c| c == hold * 5),
                    "{n} {hold}: {places:?}"
                );
            }
        }
    }

    #[test]
    fn sides_run_once_per_round_in_rotating_order() {
        let log = std::cell::RefCell::new(Vec::new());
        let mut a = |r: &Round, p: &u64| {
            log.borrow_mut().push(('a', r.index, *p));
            Ok(())
        };
        let mut b = |r: &Round, p: &u64| {
            log.borrow_mut().push(('b', r.index, *p));
            Ok(())
        };
        run_rounds(
            vec![0..2, 2..4, 4..5],
            1,
            |r| Ok(r.batches.end),
            &mut [&mut a, &mut b],
        )
        .unwrap();
        assert_eq!(
            log.into_inner(),
            vec![
                ('a', 0, 2),
                ('b', 0, 2),
                ('b', 1, 4),
                ('a', 1, 4),
                ('a', 2, 5),
                ('b', 2, 5)
            ]
        );
    }
}
