//! Read-only mappings of same-host servers' memory pools (MapPool), one
//! per pool in this process: every connection to a server shares its
//! view, so a pool of connections maps the pool once, and a mapping goes
//! when the last connection to that server instance lets go of it.

use kvtier_wire::shm::PoolView;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Weak};

static VIEWS: Mutex<Vec<Weak<PoolView>>> = Mutex::new(Vec::new());

/// The view of the pool file `fd` (of `len` bytes): the one this process
/// already has, or a new mapping. The descriptor closes on return (the
/// mapping keeps the memory).
pub(crate) fn view_of(fd: OwnedFd, len: u64) -> io::Result<Arc<PoolView>> {
    let identity = PoolView::identity_of(&fd)?;
    let mut views = VIEWS.lock().unwrap_or_else(|e| e.into_inner());
    views.retain(|v| v.strong_count() > 0);
    // A live view keeps its file, so its inode cannot name another file.
    if let Some(view) = views
        .iter()
        .filter_map(Weak::upgrade)
        .find(|v| v.identity() == identity && v.len() as u64 == len)
    {
        return Ok(view);
    }
    let view = Arc::new(PoolView::map(&fd, len)?);
    views.push(Arc::downgrade(&view));
    // Page tables filled in the background: the first copies need not
    // wait for a whole pool's worth (a second per tens of GiB).
    let populating = Arc::clone(&view);
    let _ = std::thread::Builder::new()
        .name("kvtier-pool-view".into())
        .spawn(move || populating.populate());
    Ok(view)
}
