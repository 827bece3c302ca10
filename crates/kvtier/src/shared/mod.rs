//! A region log on a shared file system (docs/design.md, "Shared
//! directory"): `dir` owns the directory's identity and this node's
//! writer directory; `follow` indexes every other writer's log as it
//! grows, so any node reads any node's blocks straight from the file
//! system.

mod checkpoint;
mod dir;
mod follow;
mod gc;
mod write_floor;

pub(crate) use checkpoint::CheckpointWriter;
pub(crate) use dir::{Holder, SharedDir};
pub use follow::SharedWriter;
pub(crate) use follow::{FollowCounters, Follower};
pub use gc::{collect_dead_writers, collect_dead_writers_where, CollectedWriter, Collection};
