//! The Rust client of a kvtier server: one connection type (`Client`) over
//! a Unix socket (with shared memory) or TCP (optionally TLS), a pool of
//! them for concurrent callers (`ClientPool`), and cluster routing (a
//! request split by owner, run on every member at once).

pub mod backend;
pub mod client;
pub mod pool;
pub mod routing;

pub use backend::{KnownLen, KvBackend};
pub use client::{Client, ClientOptions};
pub use pool::{ClientPool, Pending};
