//! KV events for cache-aware routers (llm-d's KV cache indexer, Dynamo's
//! router, Mooncake Conductor): the store's block events, published in
//! vLLM's format (`vllm/distributed/kv_events.py`) over ZeroMQ.
//!
//! - A PUB socket sends each batch as `[topic, seq (u64 big-endian),
//!   msgpack KVEventBatch]`; the topic is `<topic prefix>@<namespace>`, so
//!   a router can subscribe to one engine's namespace or to the whole node.
//! - A ROUTER socket answers replay requests (`[b"", start seq]`) with
//!   every batch still kept from `start` on, then `[b"", b"", -1, b""]`,
//!   as vLLM's publisher does: a subscriber that sees a gap in the
//!   sequence numbers fills it from here.
//! - Block hashes are the keys exactly as the engine put them; media are
//!   vLLM's: `CPU` for the memory pool, `STORAGE` for the disk tier.
//!
//! The data path never waits: the store's events go through a bounded
//! channel (`kvtier::EventSink`), every subscriber has a bounded queue,
//! and a batch that does not fit one is dropped for that subscriber only
//! (a gap it can replay). Events the store's channel dropped cannot be
//! replayed; the publisher then sends `AllBlocksCleared`, so a router
//! forgets this node rather than keeps a view that may be wrong, and
//! relearns from the events that follow. The first batch after a start
//! is `AllBlocksCleared` too: blocks from before a restart are not
//! announced again.
//!
//! What lives where:
//!
//! - `config`: `KvEventsConfig` (every field and its default), the
//!   feed's CURVE keys (`CurveKeys`, derived from the server's tokens) and
//!   the governor's principal of each login (`Principals`).
//! - `admit`: every connection's slot, a grant of the server's governor
//!   (`feed handshakes`, `feed subscribers`, `feed replays`), and which
//!   connection is closed for a newcomer.
//! - `publisher`: `KvEventPublisher` (its threads, `/stats`), the accept
//!   loop with its connection limit, and each subscriber's connection.
//! - `batcher`: the store's events into numbered, encoded batches, kept
//!   for replay and queued for each subscriber.
//! - `replay`: the ROUTER socket answering replay requests.
//! - `shared`: what the batcher and the connections share (the batches as
//!   published, subscribers, peers, counters).
//! - `greet`: a connection's handshake with the feed's mechanism, within
//!   one deadline.
//! - `msgpack`: vLLM's `KVEventBatch` encoding.
//! - `zmtp`, `frame`, `curve`: ZMTP 3 (greetings, frames, the NULL and
//!   PLAIN handshakes) and ZeroMQ CURVE; `curve::client` (feature
//!   `curve-client`) is a CURVE subscriber in Rust.
//! - `testing` (tests only): events as the store emits them, for the
//!   batcher's and the publisher's tests.

mod admit;
mod batcher;
mod config;
pub mod curve;
mod frame;
mod greet;
mod msgpack;
mod publisher;
mod replay;
mod shared;
#[cfg(test)]
mod testing;
mod zmtp;

pub use config::{CurveKeys, KvEventsConfig};
/// The governor a feed draws on (the server's, `Server::governor`; a feed
/// started on its own, in a test or a benchmark, makes one).
pub use kvtier_governor::{Governor, GuessBudget, Shares};
pub use msgpack::{encode_batch, WireEvent};
pub use publisher::{KvEventPublisher, KvEventStats};
