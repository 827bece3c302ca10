//! The dead-writer adopter: in cluster mode with a shared directory, a
//! thread that collects the logs of writers that left the cluster
//! (docs/design.md, "Dead writers").

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Cluster mode with a shared directory: collects the logs of writers that
/// are no longer members and have been idle for `grace` (docs/design.md,
/// "Dead writers"). Membership (etcd's leases) says who is dead; the
/// writer's lock on the shared file system lets one collector at a time
/// in. Never acts on an empty or stale view.
pub(crate) fn spawn(
    view: Arc<kvtier_wire::cluster::ClusterView>,
    shared: PathBuf,
    scratch: PathBuf,
    grace: std::time::Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let every = (grace / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(30),
    );
    std::thread::Builder::new()
        .name("kvtier-adopter".into())
        .spawn(move || {
            let mut next = std::time::Instant::now() + every;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(50));
                if std::time::Instant::now() < next {
                    continue;
                }
                next = std::time::Instant::now() + every;
                let members = view.members();
                let fresh = view
                    .view_age()
                    .is_some_and(|age| age < std::time::Duration::from_secs(30));
                if members.is_empty() || !fresh {
                    continue;
                }
                let live: std::collections::HashSet<String> =
                    members.iter().map(|m| m.id.clone()).collect();
                if kvtier::private_files::create_dir(&scratch).is_err() {
                    continue;
                }
                match kvtier::collect_dead_writers_where(&shared, grace, &scratch, |node| {
                    !live.contains(node)
                }) {
                    Ok(done) => {
                        for writer in done {
                            match writer.outcome {
                                kvtier::Collection::Collected { regions, bytes, kept_removals, directory_removed } => tracing::warn!(
                                    writer = %writer.node,
                                    regions,
                                    bytes,
                                    kept_removals,
                                    directory_removed,
                                    "collected the log of a writer that left the cluster"
                                ),
                                kvtier::Collection::Failed(why) => tracing::warn!(writer = %writer.node, %why, "could not collect the log of a writer that left the cluster; will retry"),
                                kvtier::Collection::Recent | kvtier::Collection::Alive => {}
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "looking for dead writers in the shared directory"),
                }
                let _ = std::fs::remove_dir_all(&scratch);
            }
        })
}
