//! Fail points: named places in the store's logic where a test makes the
//! process stop dead, to crash exactly between two steps of the crash
//! protocol (after a value is synced but before its record; after a
//! region file is unlinked but before the directory is synced; after a
//! put enters the index but before anything else sees it). raft-engine's
//! `fail_point!` is the model; the bytes-level faults stay in
//! `io/faulty.rs`.
//!
//! Without the `failpoints` feature a point compiles to nothing. With it,
//! points are armed from `KVTIER_FAILPOINTS` (read at the first hit) or
//! by `test_util::fail::arm`: `name=abort` aborts the process at the
//! first hit, `name=abort:N` at the N-th, `name=panic[:N]` panics there.

/// A fail point named `$name` (a string literal); nothing without the
/// `failpoints` feature.
macro_rules! fail_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        $crate::fail::hit($name);
    };
}
pub(crate) use fail_point;

/// Every point in the code, so a spec can only name a real one.
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
pub const POINTS: &[&str] = &[
    "disk-values-synced",
    "reclaim-region-unlinked",
    "put-indexed",
];

#[cfg(feature = "failpoints")]
pub use armed::{arm, hits};

#[cfg(feature = "failpoints")]
pub(crate) use armed::hit;

#[cfg(feature = "failpoints")]
mod armed {
    use super::POINTS;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Action {
        Abort,
        Panic,
    }

    #[derive(Debug)]
    struct Point {
        action: Action,
        /// Acts at this hit (1-based).
        at: u64,
        hits: u64,
    }

    /// Whether any point may be armed: the common case (none) costs one
    /// relaxed load.
    static MAYBE_ARMED: AtomicBool = AtomicBool::new(true);
    static POINTS_ARMED: Mutex<Option<HashMap<String, Point>>> = Mutex::new(None);

    fn parse(spec: &str) -> Result<HashMap<String, Point>, String> {
        let mut points = HashMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, how) = item
                .split_once('=')
                .ok_or_else(|| format!("fail point {item:?}: expected name=action"))?;
            if !POINTS.contains(&name) {
                return Err(format!("no fail point {name:?}; there are {POINTS:?}"));
            }
            let (action, at) = match how.split_once(':') {
                Some((action, n)) => (
                    action,
                    n.parse::<u64>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| format!("fail point {name}: bad hit number {n:?}"))?,
                ),
                None => (how, 1),
            };
            let action = match action {
                "abort" => Action::Abort,
                "panic" => Action::Panic,
                other => return Err(format!("fail point {name}: unknown action {other:?}")),
            };
            points.insert(
                name.to_string(),
                Point {
                    action,
                    at,
                    hits: 0,
                },
            );
        }
        Ok(points)
    }

    /// Arms points from a spec (`name=abort:3,other=panic`), replacing
    /// what was armed; `""` disarms all.
    pub fn arm(spec: &str) -> Result<(), String> {
        let points = parse(spec)?;
        MAYBE_ARMED.store(!points.is_empty(), Ordering::Release);
        *POINTS_ARMED.lock().unwrap() = Some(points);
        Ok(())
    }

    /// How often `name` was passed since it was armed.
    pub fn hits(name: &str) -> u64 {
        POINTS_ARMED
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|p| p.get(name))
            .map_or(0, |p| p.hits)
    }

    pub(crate) fn hit(name: &str) {
        if !MAYBE_ARMED.load(Ordering::Acquire) {
            return;
        }
        let mut guard = POINTS_ARMED.lock().unwrap();
        let points = guard.get_or_insert_with(|| {
            let spec = std::env::var("KVTIER_FAILPOINTS").unwrap_or_default();
            parse(&spec).unwrap_or_else(|e| panic!("KVTIER_FAILPOINTS: {e}"))
        });
        if points.is_empty() {
            MAYBE_ARMED.store(false, Ordering::Release);
            return;
        }
        let Some(point) = points.get_mut(name) else {
            return;
        };
        point.hits += 1;
        if point.hits != point.at {
            return;
        }
        match point.action {
            Action::Abort => {
                // Said on stderr so a parent can tell the point from any
                // other abort.
                eprintln!("fail point {name}: aborting at hit {}", point.hits);
                std::process::abort();
            }
            Action::Panic => {
                drop(guard);
                panic!("fail point {name}: hit");
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn specs_name_real_points_and_actions() {
            let points = parse("put-indexed=abort:3, disk-values-synced=panic").unwrap();
            assert_eq!(points["put-indexed"].at, 3);
            assert_eq!(points["put-indexed"].action, Action::Abort);
            assert_eq!(points["disk-values-synced"].at, 1);
            assert!(parse("").unwrap().is_empty());
            assert!(parse("nowhere=abort")
                .unwrap_err()
                .contains("no fail point"));
            assert!(parse("put-indexed=explode")
                .unwrap_err()
                .contains("unknown action"));
            assert!(parse("put-indexed=abort:0")
                .unwrap_err()
                .contains("bad hit number"));
            assert!(parse("put-indexed").unwrap_err().contains("name=action"));
        }
    }
}
