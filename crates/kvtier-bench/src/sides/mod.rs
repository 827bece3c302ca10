//! The sides a case is built from. In every round of a case each side
//! moves the same share of the case's bytes (the scheduler in
//! `schedule` rotates their order), and a row reports the store's side
//! against the others:
//!
//! - `store`: the store's own calls (`batch_put`, then `flush`, for disk
//!   puts; `batch_get_into` into page-aligned host buffers for gets);
//! - `device`: the device ceiling (the best transfer shape, as fio would
//!   run it, in cache-resident buffers and in the batch's memory) and the
//!   shape-matched stream (exactly the store's requests, raw);
//! - `memcpy`: the memory cases' baseline;
//! - `plain`: a plain program's buffered reads through a mount, the
//!   shared cases' baseline, cold and warm;
//! - `tcp`: raw loopback streams, the remote memory cases' baseline.

pub mod device;
pub mod memcpy;
pub mod plain;
pub mod store;
pub mod tcp;
