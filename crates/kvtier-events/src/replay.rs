//! The ROUTER socket answering replay requests (`[b"", start seq]`) with
//! every batch still kept from `start` on, as each peer may see it, then
//! the end marker.

use crate::admit::{Kind, PeerThread};
use crate::greet::greet;
use crate::shared::{as_seen, put_batch, Published, Stage};
use crate::zmtp;
use kvtier_governor::Grant;
use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The replay end marker: sequence number -1.
pub(crate) const END_SEQ: [u8; 8] = [0xff; 8];

/// Serves one replay peer; `handshake` is its slot until its handshake is
/// done, then a slot of the replay budget for its login's principal. It
/// may be closed for a newcomer while it has no request being answered,
/// never while one is.
pub(crate) fn serve_replay(
    mut stream: TcpStream,
    peer: &PeerThread<'_>,
    handshake: Grant,
) -> io::Result<()> {
    let (shared, config) = (peer.shared, peer.config);
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let (scope, mut frames_out, mut frames_in) = greet(
        &stream,
        config,
        "ROUTER",
        &["DEALER", "REQ", "ROUTER"],
        &|| peer.closed(),
    )?;
    let _slot = peer.logged_in(handshake, Kind::Replay, &scope, Stage::ReplayWaiting)?;
    stream.set_write_timeout(Some(config.peer_timeout))?;
    // Between requests a client may idle; the handshake deadline is over.
    stream.set_read_timeout(Some(Duration::from_secs(3600)))?;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        // One request: at most 4 frames of at most 64 bytes.
        let mut frames: Vec<Vec<u8>> = Vec::new();
        loop {
            match frames_in.read_frame(&mut stream, 64)? {
                zmtp::Frame::Message { more, body } => {
                    frames.push(body);
                    if !more {
                        break;
                    }
                    if frames.len() >= 4 {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "a replay request of more than 4 frames",
                        ));
                    }
                }
                zmtp::Frame::Command(body) => {
                    if let Some(pong) = zmtp::pong_for(&body)? {
                        let mut out = Vec::new();
                        frames_out.put_frame(&mut out, &pong, false, true)?;
                        stream.write_all(&out)?;
                    }
                }
            }
        }
        let (delimited, start) = match &frames[..] {
            [empty, start] if empty.is_empty() && start.len() == 8 => (true, start),
            [start] if start.len() == 8 => (false, start),
            _ => {
                tracing::debug!(
                    frames = frames.len(),
                    "kv events: malformed replay request ignored"
                );
                continue;
            }
        };
        let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
        // Being answered from here until the end marker is written: never
        // closed for a newcomer (unless it was already).
        peer.set_stage(None, Stage::ReplayServing)?;
        shared.replay_requests.fetch_add(1, Ordering::Relaxed);
        let kept: Vec<Arc<Published>> = shared
            .ring
            .lock()
            .unwrap()
            .0
            .iter()
            .filter(|p| p.seq >= start)
            .map(|p| Arc::clone(as_seen(&scope, p)))
            .collect();
        let mut out = Vec::new();
        for p in &kept {
            put_batch(&mut frames_out, &mut out, p, delimited)?;
            if out.len() >= 1 << 20 {
                stream.write_all(&out)?;
                out.clear();
            }
        }
        if delimited {
            frames_out.put_message(&mut out, &[b"", b"", &END_SEQ, b""])?;
        } else {
            frames_out.put_message(&mut out, &[b"", &END_SEQ, b""])?;
        }
        stream.write_all(&out)?;
        peer.set_stage(None, Stage::ReplayWaiting)?;
    }
}
