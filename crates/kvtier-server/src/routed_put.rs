//! BatchPut in cluster mode, read in groups: values are gathered as they
//! arrive, and each group of up to `GROUP_BYTES` goes to its keys' owners
//! (the router: this member's store, other members over their
//! connections) before the next group is read. A put of any size so holds
//! at most one group (or one value larger than a group) of the server's
//! buffer budget, where reading the whole frame first held all of it,
//! and the client's later values wait in its socket meanwhile (TCP's own
//! back-pressure).
//!
//! The frame is checked as `protocol::decode_request` checks it, as the
//! items arrive. A frame that breaks the rules part-way is a protocol
//! error, and the groups sent before it stay stored: each of their values
//! is whole and exactly as its client sent it (as a streamed local put
//! that ran short of pool keeps what it received).

use crate::handlers::{put_reply, result_code, Reply};
use crate::streamed_put::read_item_head;
use kvtier_client::backend::per_key;
use kvtier_client::KvBackend;
use kvtier_wire::protocol::{code, put_flags, rules, ProtocolError};
use kvtier_wire::transport::{BodyStream, ReadError, Transport};

/// The most bytes (keys and values) one group gathers before it is sent
/// on; a single value larger than this is a group of its own.
pub(crate) const GROUP_BYTES: usize = 8 << 20;

/// Reads and runs one BatchPut whose header has been read, through
/// `owners` (the router over this member's store). `group` is the
/// connection's buffer, grown only as `room(bytes)` allows (the buffer
/// budget, asked for the buffer's whole size); an item that finds no room is answered LIMIT and its bytes
/// are read past.
pub(crate) fn batch_put_routed<'b>(
    owners: &dyn KvBackend,
    transport: &mut Transport,
    mut body: BodyStream,
    max_batch: u32,
    group: &mut Vec<u8>,
    room: &mut dyn FnMut(usize) -> bool,
) -> Result<Reply<'b>, ReadError> {
    let mut head = [0u8; 5];
    transport.read_body(&mut body, &mut head)?;
    let options = put_flags::decode(head[0]);
    let n = u32::from_le_bytes(head[1..].try_into().expect("4 bytes"));
    rules::count(n, max_batch, rules::MIN_PUT_ITEM, body.remaining())
        .map_err(ReadError::Protocol)?;
    let mut codes: Vec<i32> = Vec::with_capacity(n as usize);
    // Each gathered item: its index in the batch and where its key and
    // value lie in `group`.
    let mut gathered: Vec<(usize, std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
    let mut bytes_in = 0u64;
    group.clear();
    let mut key = [0u8; kvtier::MAX_KEY_LEN];
    for i in 0..n as usize {
        let (key, len) = read_item_head(transport, &mut body, &mut key)?;
        let key_len = key.len();
        bytes_in += len;
        // Checked against the frame's remaining bytes above: it fits in
        // memory's address space.
        let len = usize::try_from(len).map_err(|_| protocol("a value past the address space"))?;
        let item = key_len + len;
        if !group.is_empty() && group.len() + item > GROUP_BYTES {
            send_group(owners, &options, group, &mut gathered, &mut codes);
        }
        codes.push(code::OK);
        if !room(group.capacity().max(group.len() + item)) {
            codes[i] = code::LIMIT;
            skip(transport, &mut body, len as u64)?;
            continue;
        }
        group.reserve_exact(item);
        let key_at = group.len()..group.len() + key_len;
        group.extend_from_slice(key);
        let value_at = group.len()..group.len() + len;
        group.resize(group.len() + len, 0);
        transport.read_body(&mut body, &mut group[value_at.clone()])?;
        gathered.push((i, key_at, value_at));
    }
    if body.remaining() != 0 {
        return Err(protocol(format!(
            "{} unexpected trailing bytes in the frame body",
            body.remaining()
        )));
    }
    send_group(owners, &options, group, &mut gathered, &mut codes);
    Ok(put_reply(&codes, bytes_in))
}

/// Puts the gathered items through `owners` and records their codes.
fn send_group(
    owners: &dyn KvBackend,
    options: &kvtier::PutOptions,
    group: &mut Vec<u8>,
    gathered: &mut Vec<(usize, std::ops::Range<usize>, std::ops::Range<usize>)>,
    codes: &mut [i32],
) {
    if !gathered.is_empty() {
        let keys: Vec<&[u8]> = gathered.iter().map(|(_, k, _)| &group[k.clone()]).collect();
        let one: Vec<[&[u8]; 1]> = gathered
            .iter()
            .map(|(_, _, v)| [&group[v.clone()]])
            .collect();
        let values: Vec<&[&[u8]]> = one.iter().map(|v| &v[..]).collect();
        let results = per_key(owners.batch_put(&keys, &values, options), keys.len());
        for ((i, _, _), result) in gathered.iter().zip(&results) {
            codes[*i] = result_code(result);
        }
    }
    gathered.clear();
    group.clear();
}

/// Reads and drops `len` body bytes (a value answered without storing).
fn skip(transport: &mut Transport, body: &mut BodyStream, len: u64) -> Result<(), ReadError> {
    let mut piece = [0u8; 64 << 10];
    let mut left = len;
    while left > 0 {
        let n = left.min(piece.len() as u64) as usize;
        transport.read_body(body, &mut piece[..n])?;
        left -= n as u64;
    }
    Ok(())
}

fn protocol(message: impl Into<String>) -> ReadError {
    ReadError::Protocol(ProtocolError::new(message.into()))
}
