//! Power loss, simulated: a model-based test over the fault-injecting io
//! engine. Random puts, removes and flushes; at random points the power is
//! cut (every later write and sync fails), the store is dropped, and each
//! file is rewritten as a disk might have left it: every write not covered
//! by a completed sync kept, dropped, or torn at 4 KiB boundaries. Then the
//! store is reopened and every key checked:
//!
//! - **lost after flush**: a value acknowledged by a completed `flush()` (or
//!   a remove that returned) is gone or older, with no later unacknowledged
//!   write to explain it;
//! - **resurrected**: a removed key is back with no later put to explain it;
//! - **wrong bytes**: a get returns bytes no put of that key wrote;
//! - **phantom exists**: `exists` reports a key whose read then misses.
//!
//! All four must be 0. The same run with the pre-format-2 protocol (record
//! and values in one write, one sync: `unsafe_single_sync_batches`) must
//! find failures, which proves the test can catch a skipped sync.
//!
//! `KVTIER_POWER_LOSS_DEBUG=1` prints each case's operations, losses and
//! recovery reports, to replay a failing seed by hand.

use crate::common::*;
use kvtier::test_util::{Dice, FaultyEngine};
use kvtier::{Config, Store};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Value(u64),
    Removed,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    cases: u64,
    power_losses: u64,
    checks: u64,
    lost_after_flush: u64,
    resurrected: u64,
    wrong_bytes: u64,
    phantom_exists: u64,
}

impl Tally {
    fn failures(&self) -> u64 {
        self.lost_after_flush + self.resurrected + self.wrong_bytes + self.phantom_exists
    }
}

const KEYS: u64 = 12;

fn value_of(key: u64, version: u64) -> Vec<u8> {
    // 1 to 3 pages and a bit, so values span page boundaries and tear.
    let len = 4096 * (1 + (version % 3) as usize) + 100 + (key as usize * 7);
    value_for(&key_bytes(key), version, len)
}

fn key_bytes(key: u64) -> Vec<u8> {
    format!("pl-key-{key}").into_bytes()
}

/// Opens the store for a case over a fresh fault-injecting engine.
fn open_case(dir: &Path, single_sync: bool, case: u64) -> (Store, Arc<FaultyEngine>) {
    let config = Config::new(dir)
        .memory_capacity(4 * MIB)
        .disk_capacity(64 * MIB)
        .region_size(MIB)
        .io_engine(engine_of_case(case))
        .unsafe_single_sync_batches(single_sync);
    open_faulty(config)
}

/// Cases alternate io engines.
fn engine_of_case(case: u64) -> kvtier::IoEngineKind {
    if case.is_multiple_of(2) {
        kvtier::IoEngineKind::Uring
    } else {
        kvtier::IoEngineKind::Psync
    }
}

/// Runs `cases` cases of `losses` power losses each.
fn run(cases: u64, losses: u64, single_sync: bool, seed: u64) -> Tally {
    let mut tally = Tally::default();
    let debug = std::env::var("KVTIER_POWER_LOSS_DEBUG").is_ok();
    for case in 0..cases {
        tally.cases += 1;
        let dir = tempfile::tempdir().unwrap();
        let mut dice = Dice::new(seed ^ case.wrapping_mul(0x1000_0001));
        // What a restart must show, and the unacknowledged writes since.
        let mut durable: HashMap<u64, State> = HashMap::new();
        let mut pending: HashMap<u64, Vec<State>> = HashMap::new();
        let mut version = 0u64;
        let (mut store, mut faulty) = open_case(dir.path(), single_sync, case);
        for loss in 0..losses {
            let ops = 5 + dice.below(25);
            // The power goes somewhere inside this round's disk writes.
            let cut_in = 1 + dice.below(12);
            let cut_at_op = dice.below(ops);
            let mut after_cut = 0;
            for op in 0..ops {
                if op == cut_at_op {
                    faulty.cut_power_after(cut_in);
                }
                // A few calls against the dead disk, then the loss.
                if faulty.is_power_cut() {
                    after_cut += 1;
                    if after_cut > 3 {
                        break;
                    }
                }
                let key = dice.below(KEYS);
                match dice.below(10) {
                    0..=5 => {
                        version += 1;
                        if debug {
                            eprintln!(
                                "  put k{key} v{version} (ops so far {})",
                                faulty.operations()
                            );
                        }
                        store.put(key_bytes(key), value_of(key, version)).unwrap();
                        pending.entry(key).or_default().push(State::Value(version));
                    }
                    6 | 7 => match store.remove(key_bytes(key)) {
                        Ok(_) => {
                            if debug {
                                eprintln!("  remove k{key} ok");
                            }
                            durable.insert(key, State::Removed);
                            pending.remove(&key);
                        }
                        Err(_) => pending.entry(key).or_default().push(State::Removed),
                    },
                    _ => {
                        let flushed = store.flush();
                        if debug {
                            eprintln!(
                                "  flush {:?} cut {}",
                                flushed.as_ref().map_err(|e| e.to_string()),
                                faulty.is_power_cut()
                            );
                        }
                        if flushed.is_ok() {
                            for (k, states) in pending.drain() {
                                durable.insert(k, *states.last().unwrap());
                            }
                        }
                    }
                }
            }
            faulty.cut_power();
            drop(store);
            let lost = faulty.apply_power_loss(dice.roll()).unwrap();
            tally.power_losses += 1;
            (store, faulty) = open_case(dir.path(), single_sync, case + loss + 1);
            if debug {
                eprintln!(
                    "case {case} loss {loss}: {lost:?} recovered {:?}",
                    store.recovery_report()
                );
            }
            check(&store, &mut durable, &mut pending, &mut tally);
        }
        drop(store);
    }
    tally
}

/// Checks every key after a reopen, then takes what was found as the new
/// truth (a surviving unacknowledged write is on disk now).
fn check(
    store: &Store,
    durable: &mut HashMap<u64, State>,
    pending: &mut HashMap<u64, Vec<State>>,
    tally: &mut Tally,
) {
    for key in 0..KEYS {
        tally.checks += 1;
        let kb = key_bytes(key);
        let said_present = store.exists(&kb);
        let got = store.get(&kb).unwrap();
        if said_present && got.is_none() {
            tally.phantom_exists += 1;
        }
        let acknowledged = durable.get(&key).copied();
        let unacknowledged = pending.remove(&key).unwrap_or_default();
        let observed = match &got {
            None => State::Removed,
            Some(bytes) => {
                let candidates = acknowledged.iter().chain(&unacknowledged);
                let version = candidates
                    .filter_map(|s| match s {
                        State::Value(v) => Some(*v),
                        State::Removed => None,
                    })
                    .find(|&v| bytes == &value_of(key, v));
                match version {
                    Some(v) => State::Value(v),
                    None => {
                        tally.wrong_bytes += 1;
                        if std::env::var("KVTIER_POWER_LOSS_DEBUG").is_ok() {
                            let matched = (1..=2000u64).find(|&v| bytes == &value_of(key, v));
                            eprintln!(
                                "wrong bytes: key {key} acknowledged {acknowledged:?} \
                                 unacknowledged {unacknowledged:?} matches version {matched:?}"
                            );
                        }
                        continue;
                    }
                }
            }
        };
        let explained = acknowledged == Some(observed)
            || unacknowledged.contains(&observed)
            || (acknowledged.is_none() && observed == State::Removed);
        if !explained {
            match observed {
                State::Removed => tally.lost_after_flush += 1,
                State::Value(_) if acknowledged == Some(State::Removed) => tally.resurrected += 1,
                State::Value(_) => tally.lost_after_flush += 1,
            }
        }
        durable.insert(key, observed);
    }
}

fn cases() -> u64 {
    std::env::var("KVTIER_POWER_LOSS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn nothing_acknowledged_is_lost_across_power_losses() {
    let tally = run(cases(), 4, false, 0x5EED);
    eprintln!("power loss, format-2 protocol: {tally:?}");
    assert!(tally.power_losses >= 4 * 256.min(cases()));
    assert_eq!(tally.failures(), 0, "{tally:?}");
}

#[test]
fn a_skipped_value_sync_is_caught() {
    // Where the flusher's writes fall relative to the cut depends on
    // thread timing, so a loaded machine may catch fewer losses per round
    // (about 6 in 64 cases when idle): try rounds of fresh seeds until one
    // catches it, failing only if none of 8 does.
    let mut tallies = Vec::new();
    for round in 0..8u64 {
        let tally = run(64, 4, true, 0xBAD5EED ^ (round << 32));
        eprintln!("power loss, single-sync protocol, round {round}: {tally:?}");
        if tally.failures() > 0 {
            return;
        }
        tallies.push(tally);
    }
    panic!("the power-loss test did not notice record and values synced together: {tallies:?}");
}

/// What one caller did, in completion order, for the concurrent model.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// A put or remove returned (`durable`: a remove that returned Ok).
    Wrote {
        key: u64,
        state: State,
        durable: bool,
    },
    /// A flush returned Ok: every event before `covers` is durable.
    Flushed { covers: usize },
}

/// The model with reclaim and two callers: a small disk tier (reclaim and
/// second-chance carries run between the losses), and a second thread
/// putting, reading, removing and flushing its own keys while the first
/// does the same and the power goes. Checks as above, except that a value
/// reclaimed for capacity may be gone (counted, not a failure): nothing
/// removed may return, no wrong bytes, no phantom `exists`.
fn run_concurrent(cases: u64, losses: u64, seed: u64) -> (Tally, u64, u64) {
    let mut tally = Tally::default();
    let mut reclaimed_away = 0u64;
    let mut reclaims = 0u64;
    for case in 0..cases {
        tally.cases += 1;
        let dir = tempfile::tempdir().unwrap();
        let reopen = |dir: &Path, case: u64| {
            let config = Config::new(dir)
                .memory_capacity(MIB)
                .disk_capacity(256 * KIB)
                .region_size(64 * KIB)
                .put_wait(std::time::Duration::from_millis(50))
                .io_engine(engine_of_case(case));
            let (store, faulty) = open_faulty(config);
            (Arc::new(store), faulty)
        };
        let mut durable: HashMap<u64, State> = HashMap::new();
        let (mut store, mut faulty) = reopen(dir.path(), case);
        for loss in 0..losses {
            let events: Arc<Mutex<Vec<Event>>> = Arc::default();
            let callers: Vec<_> = (0..2u64)
                .map(|caller| {
                    let (store, events) = (Arc::clone(&store), Arc::clone(&events));
                    let mut dice = Dice::new(seed ^ (case << 8) ^ (loss << 4) ^ caller);
                    std::thread::spawn(move || {
                        for _ in 0..20 {
                            // Each caller owns half the keys.
                            let key = caller * (KEYS / 2) + dice.below(KEYS / 2);
                            match dice.below(10) {
                                0..=4 => {
                                    let version =
                                        (caller << 40) | (loss << 32) | dice.below(1 << 31);
                                    if store.put(key_bytes(key), value_of(key, version)).is_ok() {
                                        events.lock().unwrap().push(Event::Wrote {
                                            key,
                                            state: State::Value(version),
                                            durable: false,
                                        });
                                    }
                                }
                                5 | 6 => {
                                    let _ = store.get(key_bytes(key));
                                }
                                7 => {
                                    let ok = store.remove(key_bytes(key)).is_ok();
                                    events.lock().unwrap().push(Event::Wrote {
                                        key,
                                        state: State::Removed,
                                        durable: ok,
                                    });
                                }
                                _ => {
                                    let covers = events.lock().unwrap().len();
                                    if store.flush().is_ok() {
                                        events.lock().unwrap().push(Event::Flushed { covers });
                                    }
                                }
                            }
                        }
                    })
                })
                .collect();
            // The power goes while both callers work.
            faulty.cut_power_after(1 + (seed ^ case ^ loss) % 40);
            for caller in callers {
                caller.join().unwrap();
            }
            faulty.cut_power();
            reclaims += store.stats().reclaimed_regions;
            let store_only = Arc::into_inner(store).expect("callers are done");
            drop(store_only);
            faulty
                .apply_power_loss(seed.wrapping_add(case * 31 + loss))
                .unwrap();
            tally.power_losses += 1;
            // Per key: durable state, and what may have survived after it.
            let events = Arc::into_inner(events).unwrap().into_inner().unwrap();
            let mut pending: HashMap<u64, Vec<State>> = HashMap::new();
            let covered_upto = events
                .iter()
                .filter_map(|e| match e {
                    Event::Flushed { covers } => Some(*covers),
                    Event::Wrote { .. } => None,
                })
                .max()
                .unwrap_or(0);
            for (i, event) in events.iter().enumerate() {
                if let Event::Wrote {
                    key,
                    state,
                    durable: d,
                } = *event
                {
                    if i < covered_upto || d {
                        // Later events for the key may still have landed.
                        durable.insert(key, state);
                        pending.remove(&key);
                    } else {
                        pending.entry(key).or_default().push(state);
                    }
                }
            }
            (store, faulty) = reopen(dir.path(), case + loss + 1);
            reclaims += store.stats().reclaimed_regions;
            let before = tally.lost_after_flush;
            check(&store, &mut durable, &mut pending, &mut tally);
            // With reclaim, a lost value may have been dropped for room.
            if tally.lost_after_flush > before {
                reclaimed_away += tally.lost_after_flush - before;
                tally.lost_after_flush = before;
            }
        }
    }
    (tally, reclaims, reclaimed_away)
}

#[test]
fn concurrent_callers_and_reclaim_survive_power_losses() {
    let (tally, reclaims, reclaimed_away) = run_concurrent(cases() / 4, 4, 0xC0_FFEE);
    eprintln!(
        "power loss, two callers, reclaim active: {tally:?}, regions reclaimed {reclaims}, \
         values gone to reclaim {reclaimed_away}"
    );
    assert_eq!(
        tally.resurrected + tally.wrong_bytes + tally.phantom_exists,
        0,
        "{tally:?}"
    );
    if cases() >= 16 {
        assert!(
            reclaims > 0,
            "the disk never filled: reclaim was not exercised"
        );
    }
}
