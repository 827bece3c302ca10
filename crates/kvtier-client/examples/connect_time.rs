//! How long a client's connect takes, with the default options (the
//! default 256 MiB shared buffer registered, cross-memory and the pool map
//! where the server offers them): `connect_time URL [N]` connects N times
//! (default 1) in this process, one connection at a time, and prints each
//! in milliseconds, then the median. The first connect of a fresh process
//! is what a short-lived client pays: run it as fresh processes for that
//! figure (docs/benchmarks.md, "Connecting").

use kvtier_client::{ClientOptions, Connection};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or("usage: connect_time URL [N]")?;
    let n: usize = args.next().map_or(Ok(1), |n| n.parse())?;
    let options = ClientOptions {
        auth_token: std::env::var("KVTIER_AUTH_TOKEN").ok(),
        ..ClientOptions::default()
    };
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let started = Instant::now();
        let connection = Connection::connect_with(&url, options.clone())?;
        ms.push(started.elapsed().as_secs_f64() * 1e3);
        drop(connection);
    }
    for m in &ms {
        println!("connect {m:.2} ms");
    }
    ms.sort_by(f64::total_cmp);
    println!("median {:.2} ms over {}", ms[ms.len() / 2], ms.len());
    Ok(())
}
