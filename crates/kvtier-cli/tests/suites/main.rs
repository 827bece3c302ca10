//! The CLI's suites against the real `kvtier` binary, as one test binary
//! (one link instead of nine): a module per suite. Cluster mode's suite
//! (`tests/cluster.rs`) stays its own binary: it needs the `cluster`
//! feature.

#[path = "../common/mod.rs"]
mod common;

mod cross_memory;
mod descriptors;
mod feed_governor;
mod governor;
mod hostile_clients;
mod lockout;
mod namespaces;
mod pool_map;
mod private_at_rest;
mod server;
mod shared_storage;
mod shm_trust;
mod tenants;
mod tls;
