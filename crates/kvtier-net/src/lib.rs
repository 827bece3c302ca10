//! kvtier over the network: the wire protocol (docs/protocol.md), the
//! server behind `kvtier serve`, and the Rust client.

pub mod admin;
pub mod client;
pub mod cluster;
pub mod metrics;
pub mod pool;
pub mod protocol;
pub mod server;
pub mod shm;
pub mod tls;
pub mod transport;

pub use client::{Client, ClientOptions};
pub use pool::{ClientPool, Pending};
pub use server::{BoundAddrs, Server, ServerConfig};
