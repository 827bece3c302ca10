//! BatchPut read from the connection item by item: each value goes from
//! the socket straight into its pool extent (`kvtier::StreamedPuts`), with
//! no frame buffer in between, so a put's bytes are copied once on this
//! host, as a raw socket reader's are.
//!
//! The frame is checked as `protocol::decode_request` checks it, as the
//! items arrive; a frame that breaks the rules is a protocol error and
//! enters nothing (unless the pool ran short part-way, which enters the
//! values received so far first: each exactly as its client sent it).

use crate::handlers::{put_reply, result_code, Reply};
use crate::limits::{Budgets, Held};
use kvtier::NamespacedStore;
use kvtier_wire::protocol::{put_flags, rules, ProtocolError};
use kvtier_wire::transport::{BodyStream, ReadError, Transport};
use std::time::Duration;

/// Reads and runs one BatchPut whose header has been read; `discard` is
/// scratch space for the bytes of values that are not stored.
///
/// A value takes its length from `receiving` (the server-wide budget of
/// values still arriving) before it gets a pool extent, and gives it back
/// once its bytes are all in: announced lengths pin at most that share of
/// the pool, whatever a client announces and however slowly it sends.
/// Without room within `RECEIVING_WAIT` the item is answered NO_SPACE.
pub(crate) fn batch_put_streamed<'b>(
    store: &NamespacedStore,
    transport: &mut Transport,
    mut body: BodyStream,
    max_batch: u32,
    discard: &mut Vec<u8>,
    receiving: &Budgets,
) -> Result<Reply<'b>, ReadError> {
    let mut head = [0u8; 5];
    transport.read_body(&mut body, &mut head)?;
    let flags = head[0];
    let n = u32::from_le_bytes(head[1..].try_into().expect("4 bytes"));
    rules::count(n, max_batch, rules::MIN_PUT_ITEM, body.remaining())
        .map_err(ReadError::Protocol)?;
    let mut puts = store.streamed_puts(&put_flags::decode(flags), n as usize, body.remaining());
    let mut key = [0u8; kvtier::MAX_KEY_LEN];
    let mut bytes_in = 0;
    for _ in 0..n {
        let (key, len) = read_item_head(transport, &mut body, &mut key)?;
        bytes_in += len;
        let Some(permit) = take_receiving(receiving, len) else {
            puts.refuse(kvtier::Error::new(
                kvtier::ErrorKind::NoSpace,
                format!(
                    "the server is receiving {} bytes of unfinished values (this principal: \
                     {:?}), the most it lets arrive at once (max_receiving_bytes, a tenant's \
                     share: {}); retry",
                    receiving.used().0,
                    receiving.used().1,
                    receiving.limit()
                ),
            ));
            skip(transport, &mut body, len, discard)?;
            continue;
        };
        match puts.begin(key, len) {
            Some(mut value) => {
                // `fill` speaks io::Error; the read's own error is kept.
                let mut failed = None;
                let filled = value.fill(|chunk| {
                    transport.read_body(&mut body, chunk).map_err(|e| {
                        failed = Some(e);
                        std::io::Error::other("reading a value")
                    })
                });
                if filled.is_err() {
                    return Err(failed.expect("a failed fill kept its error"));
                }
                drop(permit);
                puts.received(key, value);
            }
            None => skip(transport, &mut body, len, discard)?,
        }
    }
    if body.remaining() != 0 {
        return Err(protocol(format!(
            "{} unexpected trailing bytes in the frame body",
            body.remaining()
        )));
    }
    let codes: Vec<i32> = puts.finish().iter().map(result_code).collect();
    Ok(put_reply(&codes, bytes_in))
}

/// Reads one BatchPut item's key (into `key`) and value length, checked
/// as `protocol::decode_request` checks them; the value's bytes follow.
pub(crate) fn read_item_head<'k>(
    transport: &mut Transport,
    body: &mut BodyStream,
    key: &'k mut [u8; kvtier::MAX_KEY_LEN],
) -> Result<(&'k [u8], u64), ReadError> {
    let mut key_len = [0u8; 2];
    transport.read_body(body, &mut key_len)?;
    let key_len = usize::from(u16::from_le_bytes(key_len));
    rules::key_len(key_len).map_err(ReadError::Protocol)?;
    let key = &mut key[..key_len];
    transport.read_body(body, key)?;
    let mut len = [0u8; 8];
    transport.read_body(body, &mut len)?;
    let len = u64::from_le_bytes(len);
    rules::value_len(len, body.remaining()).map_err(ReadError::Protocol)?;
    Ok((key, len))
}

/// How long a value waits for room in the receiving budget.
const RECEIVING_WAIT: Duration = Duration::from_secs(2);

/// Takes `len` bytes of `receiving`, waiting up to `RECEIVING_WAIT` for
/// values in flight elsewhere to finish. (A value larger than the whole
/// budget is let through alone, when nothing else is arriving.)
fn take_receiving(receiving: &Budgets, len: u64) -> Option<Held> {
    receiving.take_within(len.min(receiving.limit()), RECEIVING_WAIT)
}

/// Reads and drops `len` body bytes (a value answered without storing).
fn skip(
    transport: &mut Transport,
    body: &mut BodyStream,
    len: u64,
    discard: &mut Vec<u8>,
) -> Result<(), ReadError> {
    const PIECE: usize = 256 << 10;
    if discard.len() < PIECE {
        discard.resize(PIECE, 0);
    }
    let mut left = len;
    while left > 0 {
        let n = left.min(PIECE as u64) as usize;
        transport.read_body(body, &mut discard[..n])?;
        left -= n as u64;
    }
    Ok(())
}

fn protocol(message: String) -> ReadError {
    ReadError::Protocol(ProtocolError::new(message))
}
