//! What publishing KV events costs batch puts, in one process: two
//! memory-only stores, one feeding a `KvEventPublisher`, put into in
//! alternating rounds. Prints the median rates and their ratio as JSON.
//!
//!     cargo run --release -p kvtier-node --example kv_events_cost [rounds]

use kvtier::{Config, EventSink, Store};
use kvtier_events::{KvEventPublisher, KvEventsConfig};
use std::sync::Arc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(21, |r| r.parse().expect("rounds"));
    // `control`: neither store publishes (the ratio noise alone gives).
    let control = std::env::args().nth(2).is_some_and(|a| a == "control");
    let (value_len, batch, per_round) = (64 << 10, 64usize, 32usize);
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let (sink, rx) = EventSink::channel(1 << 16);
    let config = |d: &tempfile::TempDir| {
        Config::new(d.path())
            .memory_capacity(1 << 30)
            .disk_capacity(0)
    };
    let plain = Store::open(config(&dirs[0])).unwrap();
    let evented = if control {
        Store::open(config(&dirs[1])).unwrap()
    } else {
        Store::open(config(&dirs[1]).events(Arc::clone(&sink))).unwrap()
    };
    let publisher = KvEventPublisher::start(
        KvEventsConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            "bench",
            kvtier_events::Governor::new(
                0,
                kvtier_events::Shares::default(),
                kvtier_events::GuessBudget::new(10, std::time::Duration::from_secs(1)),
            ),
        ),
        Arc::clone(&sink),
        rx,
    )
    .unwrap();
    let values: Vec<Vec<u8>> = (0..batch).map(|i| vec![i as u8 + 1; value_len]).collect();
    let mut rates = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let store = if which == 0 { &plain } else { &evented };
            let started = Instant::now();
            for j in 0..per_round {
                let keys: Vec<Vec<u8>> = (0..batch)
                    .map(|i| format!("{j}-{i}").into_bytes())
                    .collect();
                for result in store.batch_put(&keys, &values) {
                    result.unwrap();
                }
            }
            let bytes = (value_len * batch * per_round) as f64;
            rates[which].push(bytes / started.elapsed().as_secs_f64() / 1e6);
        }
    }
    let (p, e) = (median(rates[0].clone()), median(rates[1].clone()));
    std::thread::sleep(std::time::Duration::from_millis(100));
    let stats = publisher.stats();
    println!(
        "{{\"plain_MBps\": {p:.0}, \"events_MBps\": {e:.0}, \"events_vs_plain\": {:.4}, \"events_published\": {}, \"store_dropped\": {}}}",
        e / p,
        stats.events,
        stats.store_dropped
    );
}
