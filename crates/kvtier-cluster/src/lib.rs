//! Cluster membership on etcd. A node registers itself under
//! `/kvtier/<cluster>/members/<node-id>` with a lease, keeps the lease
//! alive, and watches the member prefix to keep its [`ClusterView`]
//! current. Nothing per key is ever written to etcd: placement is computed
//! from the member list alone (`kvtier_wire::cluster::owners`).
//!
//! Failures are ordinary events: when etcd cannot be reached (or has no
//! quorum) the node keeps serving with its last view and registers again
//! when etcd answers; when its lease expired meanwhile (a pause, a
//! partition), it registers under a new incarnation. It never exits for
//! etcd's sake.

mod access;
mod incarnation;
mod membership;

pub use access::EtcdAccess;
pub use incarnation::new_incarnation;
pub use kvtier_wire::cluster::{ClusterView, Member};
pub use membership::{list_members, member_prefix, Membership, MembershipConfig};
