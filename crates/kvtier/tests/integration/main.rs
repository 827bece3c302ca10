//! The core's integration tests, as one test binary (the crate is linked
//! once, not once per suite). Each module is a suite; run one with
//! `cargo test -p kvtier --test integration -- crash::`.

mod api;
mod capacity;
mod common;
mod corruption;
mod crash;
mod directory_damage;
mod events;
mod full_disk;
mod io_deadline;
mod io_faults;
mod local_checkpoint;
mod model;
mod namespaces;
mod power_loss;
mod shared;
