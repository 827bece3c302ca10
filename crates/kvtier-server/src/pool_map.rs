//! Pool mapping: a same-user, full-scope client on the Unix socket maps the
//! store's memory pool read-only (MapPool), leases the memory copies of the
//! values it wants (LeaseValues), copies them out of its own mapping with a
//! plain `memcpy`, and ends the lease (ReleaseLease). A value then crosses
//! once, at memory speed, on the client's cores: no copy on the server, and
//! no cross-memory attach (which pins the target's pages as it goes and
//! copies a third slower here).
//!
//! What the client can do with it: read every value the pool holds, of
//! every namespace, which is why only clients that could read them all
//! anyway are offered it (the server's user or root, trusted by their
//! kernel credentials, without a tenant's scope). What it cannot: change a
//! byte of the pool (the memory file is sealed against writable mappings,
//! `write()`, hole punching and resizing: `kvtier::Config::shareable_memory`),
//! read a value after its extent was reused (a leased extent is held until
//! the lease ends, by the client or with its connection), or pin more of
//! the pool than the leasing budget (a quarter of the memory tier, all
//! connections together) and `MAX_LEASES` leases a connection.

use crate::handlers::Reply;
use crate::limits::{Budget, Permit};
use kvtier_wire::protocol::{code, encode_lease_reply, Leased, Writer};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// Leases one connection may hold at once: a client copies a batch and
/// ends its lease before the next, so a few cover pipelined callers.
pub(crate) const MAX_LEASES: usize = 64;

/// The leasing budget: the part of the memory tier leased extents may
/// hold, all connections together.
pub(crate) fn leasing_budget(memory_capacity: u64) -> Arc<Budget> {
    Budget::new((memory_capacity / 4).max(kvtier::MIB))
}

/// The extents a connection's client holds by lease, by lease id.
#[derive(Default)]
pub(crate) struct ClientLeases {
    held: HashMap<u64, (Vec<kvtier::ValueLease>, Permit)>,
    next: u64,
}

impl ClientLeases {
    /// Leases the memory copies of `items` (key, the client's room for the
    /// value) from `store`, out of `budget`.
    pub(crate) fn lease<'b>(
        &mut self,
        store: &kvtier::NamespacedStore,
        items: &[(&[u8], u64)],
        budget: &Arc<Budget>,
    ) -> Reply<'b> {
        if self.held.len() >= MAX_LEASES {
            return Reply::error(
                code::LIMIT,
                format!(
                    "this connection holds {MAX_LEASES} leases, the most it may: release one \
                     (ReleaseLease) before leasing more"
                ),
            );
        }
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| *k).collect();
        let rooms: Vec<usize> = items
            .iter()
            .map(|&(_, room)| usize::try_from(room).unwrap_or(usize::MAX))
            .collect();
        let mut table = Vec::with_capacity(items.len());
        let mut leased = Vec::new();
        for found in store.batch_memory_leases(&keys, &rooms) {
            table.push(match found {
                Some(Ok(lease)) => {
                    let item = Leased {
                        code: code::OK,
                        offset: lease.pool_offset(),
                        len: lease.len() as u64,
                    };
                    leased.push(lease);
                    item
                }
                // Not leased; the client's get of the key answers it in
                // full (a too-small buffer's answer carries the length).
                Some(Err(e)) => Leased {
                    code: code::of(e.kind()),
                    offset: 0,
                    len: 0,
                },
                // No memory copy: the client gets it with a get.
                None => Leased {
                    code: code::NOT_FOUND,
                    offset: 0,
                    len: 0,
                },
            });
        }
        let bytes: u64 = leased.iter().map(|l| l.len() as u64).sum();
        let Some(permit) = budget.try_take(bytes) else {
            return Reply::error(
                code::LIMIT,
                format!(
                    "leased values hold {} of the {} bytes of the pool clients may lease at once \
                     (a quarter of the memory tier); get these values instead",
                    budget.used(),
                    budget.limit()
                ),
            );
        };
        self.next += 1;
        let id = self.next;
        if !leased.is_empty() {
            self.held.insert(id, (leased, permit));
        }
        Reply::ok(encode_lease_reply(id, &table))
    }

    /// Ends lease `id`: its extents may be reused once nothing else holds
    /// them. Ending one that is not held (already ended, never given, or
    /// one that leased nothing) is not an error.
    pub(crate) fn release<'b>(&mut self, id: u64) -> Reply<'b> {
        self.held.remove(&id);
        Reply::ok(Vec::new())
    }
}

/// The reply to MapPool: the pool's length, with a descriptor of its
/// memory file (which maps read-only only) to pass along.
pub(crate) fn map_reply<'b>(store: &kvtier::Store) -> Reply<'b> {
    let Some((file, len)) = store.pool_memory_file() else {
        return Reply::error(code::UNSUPPORTED, "this server's pool is not shareable");
    };
    let passed: OwnedFd = match file.try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            return Reply::error(
                code::LIMIT,
                format!("no descriptor to pass the pool with: {e}"),
            )
        }
    };
    let mut w = Writer::default();
    w.u64(len);
    Reply::ok(w.buf).passing(passed)
}
