//! The Rust client of a kvtier server, in layers: a connection to one
//! server (`Connection`, over a Unix socket with shared memory, or TCP,
//! optionally TLS), cluster routing over connections to every member
//! (`routing`: a request split by owner, run on every member at once),
//! `Client` composing the two, and a pool of clients for concurrent
//! callers (`ClientPool`).

pub mod backend;
pub mod client;
pub mod conn;
pub mod kept_threads;
pub mod pool;
mod pool_views;
pub mod routing;

pub use backend::KvBackend;
pub use client::Client;
pub use conn::{ClientOptions, Connection, KnownLen};
pub use pool::{ClientPool, Pending};
