//! A region log on a shared file system (docs/design.md, "Shared
//! directory"): `dir` owns the directory's identity and this node's
//! writer directory; `follow` indexes every other writer's log as it
//! grows, so any node reads any node's blocks straight from the file
//! system; `steps` bounds each writer's step of a follow pass in time.

mod dir;
mod follow;
mod steps;
mod write_floor;

pub(crate) use dir::{writer_lock_held, WRITER_LOCK_FILE};
pub(crate) use dir::{Holder, SharedDir};
pub use follow::SharedWriter;
pub(crate) use follow::{FollowCounters, Follower};
