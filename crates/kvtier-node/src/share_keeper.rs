//! The bounded index mode's keeper: a thread that gives the store its
//! share of the other writers' keys whenever the cluster's member list
//! changes (docs/design.md, "The bounded index").

use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The bounded index mode: gives the store its share of the other
/// writers' keys whenever the member list changes (the keys whose
/// `index_share_owner` is this node, the owner every member's router asks).
/// Never from an empty or stale view, or one without this node: the share
/// held stays (a stale share costs misses, not wrong bytes).
pub(crate) fn spawn(
    view: Arc<kvtier_wire::cluster::ClusterView>,
    store: Arc<kvtier::Store>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvtier-share".into())
        .spawn(move || {
            // Members (id, capacity) of the share given last.
            let mut given: Option<Vec<(String, u64)>> = None;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(100));
                let members = view.members();
                let me = view.me().id;
                let fresh = view
                    .view_age()
                    .is_some_and(|age| age < std::time::Duration::from_secs(30));
                if members.is_empty() || !fresh || !members.iter().any(|m| m.id == me) {
                    continue;
                }
                let mut now: Vec<(String, u64)> =
                    members.iter().map(|m| (m.id.clone(), m.capacity)).collect();
                now.sort();
                if given.as_ref() == Some(&now) {
                    continue;
                }
                let share_members = Arc::clone(&members);
                let share_me = me.clone();
                let set = store.set_index_share(move |hash| {
                    kvtier_wire::cluster::index_share_owner(hash, &share_members)
                        .is_some_and(|m| m.id == share_me)
                });
                match set {
                    Ok(()) => {
                        tracing::info!(
                            members = now.len(),
                            "the index share follows the member list"
                        );
                        given = Some(now);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot set the index share");
                        return;
                    }
                }
            }
        })
}
