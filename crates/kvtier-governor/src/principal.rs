//! Who holds a share: the principals every budget is split between.

use std::fmt;

/// Whoever a slot, a byte or a turn is charged to.
///
/// - `Server`: the server's own token, and same-user peers trusted by
///   their credentials (the operator). It may use a whole budget, and a
///   reserve of every budget is kept for it alone.
/// - `Tenant(i)`: the `i`-th tenant of the tenants file (its token). Each
///   holds at most its share and can always reach its floor.
/// - `Anonymous`: every peer that has proven nothing yet, together, as one
///   principal with the smallest share and no floor: unauthenticated
///   sockets never take what a token holder needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Principal {
    Server,
    Anonymous,
    Tenant(usize),
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Server => f.write_str("the server's token"),
            Principal::Anonymous => f.write_str("unauthenticated peers"),
            Principal::Tenant(i) => write!(f, "tenant #{i}"),
        }
    }
}
