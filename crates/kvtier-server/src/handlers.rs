//! One plain function per operation: a store seen through the
//! connection's namespace and a decoded request in, a reply out. Nothing
//! here knows about sockets, sessions or limits other than those passed in.

use crate::metrics::Sample;
use kvtier::ValueLease;
use kvtier::{AlignedBuf, ForeignSegments};
use kvtier_client::backend::per_key;
use kvtier_client::{KnownLen, KvBackend};
use kvtier_wire::protocol::{code, put_flags, Writer};
use kvtier_wire::shm::SharedRegion;
use std::collections::HashMap;

/// A request's reply: frame status, body, and value bytes sent after it.
#[derive(Debug)]
pub(crate) struct Reply<'b> {
    pub status: i32,
    pub body: Vec<u8>,
    pub tail: Vec<&'b [u8]>,
    pub sample: Sample,
    /// Close the connection after sending.
    pub close: bool,
    /// A descriptor sent with the reply (Unix sockets only).
    pub pass: Option<std::os::fd::OwnedFd>,
}

impl<'b> Reply<'b> {
    pub fn ok(body: Vec<u8>) -> Self {
        Reply {
            status: code::OK,
            body,
            tail: Vec::new(),
            sample: Sample::default(),
            close: false,
            pass: None,
        }
    }

    pub fn error(status: i32, message: impl Into<String>) -> Self {
        Reply {
            status,
            body: message.into().into_bytes(),
            tail: Vec::new(),
            sample: Sample {
                error: true,
                ..Sample::default()
            },
            close: false,
            pass: None,
        }
    }

    /// Sends `fd` with the reply.
    pub(crate) fn passing(mut self, fd: std::os::fd::OwnedFd) -> Self {
        self.pass = Some(fd);
        self
    }

    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    pub(crate) fn with_sample(mut self, sample: Sample) -> Self {
        self.sample = sample;
        self
    }
}

pub(crate) fn result_code<T>(result: &kvtier::Result<T>) -> i32 {
    match result {
        Ok(_) => code::OK,
        Err(e) => code::of(e.kind()),
    }
}

/// The reply to a batch put: a code per key.
pub(crate) fn put_reply<'b>(codes: &[i32], bytes_in: u64) -> Reply<'b> {
    let mut w = Writer::with_capacity(4 + 4 * codes.len());
    w.u32(codes.len() as u32);
    for &c in codes {
        w.i32(c);
    }
    Reply::ok(w.buf).with_sample(Sample {
        keys: codes.len() as u64,
        bytes_in,
        error: codes.iter().any(|&c| c != code::OK),
        ..Sample::default()
    })
}

/// Above this many bytes of reply staging sized by the callers' room (keys
/// whose length is not known here: another member's), a get first asks
/// the members holding those keys for their lengths (one round trip each),
/// so that what is staged follows the data, not the request. Gets of
/// absent keys with large rooms held a node's whole buffer budget.
pub(crate) const PROBE_ABOVE: usize = 1 << 20;

/// Replaces `Unknown` lengths in `known` by the holders' answers when
/// staging those keys by their room would take more than `PROBE_ABOVE`.
pub(crate) fn learn_unknown_lens(
    backend: &dyn KvBackend,
    keys: &[&[u8]],
    capacities: &[usize],
    room: usize,
    known: &mut [KnownLen],
) {
    let unknown: Vec<usize> = (0..keys.len())
        .filter(|&i| known[i] == KnownLen::Unknown)
        .collect();
    let staged = unknown.iter().fold(0usize, |sum, &i| {
        sum.saturating_add(room.min(capacities[i]))
    });
    if staged <= PROBE_ABOVE {
        return;
    }
    let probe_keys: Vec<&[u8]> = unknown.iter().map(|&i| keys[i]).collect();
    for (&i, learned) in unknown.iter().zip(backend.probe_lens(&probe_keys)) {
        known[i] = learned;
    }
}

/// The value length to state for each BUFFER_TOO_SMALL answer: what
/// `learned` says, else what the backend knows here, else (a value held by
/// another member: the length did not cross the hop) what the holders say
/// when asked. `Unknown` for every other answer.
pub(crate) fn too_small_lens(
    backend: &dyn KvBackend,
    keys: &[&[u8]],
    results: &[kvtier::Result<Option<usize>>],
    learned: &[KnownLen],
) -> Vec<KnownLen> {
    let mut lens = vec![KnownLen::Unknown; keys.len()];
    let mut ask: Vec<usize> = Vec::new();
    for (i, result) in results.iter().enumerate() {
        if !matches!(result, Err(e) if e.kind() == kvtier::ErrorKind::BufferTooSmall) {
            continue;
        }
        lens[i] = match learned[i] {
            KnownLen::Len(len) => KnownLen::Len(len),
            _ => backend.known_len(keys[i]),
        };
        if !matches!(lens[i], KnownLen::Len(_)) {
            ask.push(i);
        }
    }
    if !ask.is_empty() {
        let asked: Vec<&[u8]> = ask.iter().map(|&i| keys[i]).collect();
        for (&i, known) in ask.iter().zip(backend.probe_lens(&asked)) {
            lens[i] = known;
        }
    }
    lens
}

/// The per-key table of a batch get: `u32 n, n × (i32 code, u64 len)`;
/// `len` is the bytes sent for OK, the value's length (from `known`, 0
/// where not known) for BUFFER_TOO_SMALL, else 0.
pub(crate) fn get_table(
    results: &[kvtier::Result<Option<usize>>],
    known: impl Fn(usize) -> KnownLen,
) -> (Writer, u64) {
    let mut w = Writer::with_capacity(4 + 12 * results.len());
    w.u32(results.len() as u32);
    let mut bytes_out = 0;
    for (i, result) in results.iter().enumerate() {
        match result {
            Ok(Some(n)) => {
                w.i32(code::OK).u64(*n as u64);
                bytes_out += *n as u64;
            }
            Ok(None) => {
                w.i32(code::NOT_FOUND).u64(0);
            }
            Err(e) if e.kind() == kvtier::ErrorKind::BufferTooSmall => {
                let len = match known(i) {
                    KnownLen::Len(len) => len as u64,
                    _ => 0,
                };
                w.i32(code::BUFFER_TOO_SMALL).u64(len);
            }
            Err(e) => {
                w.i32(code::of(e.kind())).u64(0);
            }
        }
    }
    (w, bytes_out)
}

pub(crate) fn batch_put<'b>(
    backend: &dyn KvBackend,
    flags: u8,
    items: &[(&[u8], &[u8])],
) -> Reply<'b> {
    let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
    let one: Vec<[&[u8]; 1]> = items.iter().map(|i| [i.1]).collect();
    let values: Vec<&[&[u8]]> = one.iter().map(|v| &v[..]).collect();
    let results = per_key(
        backend.batch_put(&keys, &values, &put_flags::decode(flags)),
        keys.len(),
    );
    let codes: Vec<i32> = results.iter().map(result_code).collect();
    put_reply(&codes, items.iter().map(|i| i.1.len() as u64).sum())
}

/// Values come back after the per-key table with no copy into a reply:
/// memory hits straight from their pool extents (held by leases in
/// `leases` until the reply is sent), the rest from page-aligned slots of
/// `arena` that the reads land in (disk reads, or values from other
/// members). `arena` and `leases` are the connection's, reused from
/// request to request. A slot holds the value's indexed length where the
/// backend knows it, else the key's capacity bounded by `largest` (the
/// most a put may store). A larger arena is taken only if `grant` allows
/// its size (the server's buffer budget), else the request is answered
/// LIMIT with `spent`'s message.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_get<'b>(
    backend: &dyn KvBackend,
    items: &[(&[u8], u64)],
    arena: &'b mut Option<AlignedBuf>,
    leases: &'b mut Vec<Option<ValueLease>>,
    max_frame: u64,
    largest: u64,
    grant: &mut dyn FnMut(usize) -> bool,
    spent: &dyn Fn() -> String,
) -> Reply<'b> {
    let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
    let capacities: Vec<usize> = items
        .iter()
        .map(|i| usize::try_from(i.1).unwrap_or(usize::MAX))
        .collect();
    let mut results: Vec<kvtier::Result<Option<usize>>> = Vec::with_capacity(items.len());
    leases.clear();
    for leased in backend.batch_memory_leases(&keys, &capacities) {
        match leased {
            Some(Ok(lease)) => {
                results.push(Ok(Some(lease.len())));
                leases.push(Some(lease));
            }
            Some(Err(e)) => {
                results.push(Err(e));
                leases.push(None);
            }
            None => {
                results.push(Ok(None));
                leases.push(None);
            }
        }
    }
    // Keys still to read: those with no memory copy here.
    let unleased: Vec<usize> = (0..items.len())
        .filter(|&i| leases[i].is_none() && results[i].is_ok())
        .collect();
    let room = usize::try_from(largest).unwrap_or(usize::MAX);
    let mut known: Vec<KnownLen> = (0..items.len())
        .map(|i| {
            if unleased.binary_search(&i).is_ok() {
                backend.known_len(keys[i])
            } else {
                KnownLen::Absent
            }
        })
        .collect();
    learn_unknown_lens(backend, &keys, &capacities, room, &mut known);
    // A value known not to fit its caller's room is not read; the reply
    // says its length.
    let learned = known.clone();
    for &i in &unleased {
        if let KnownLen::Len(len) = known[i] {
            if len > capacities[i] {
                results[i] = Err(kvtier::Error::buffer_too_small(
                    len as u64,
                    capacities[i] as u64,
                ));
                known[i] = KnownLen::Absent;
            }
        }
    }
    // What each key may send: a leased value's length, or (for the rest)
    // the known length or else the room a value may take, bounded by the
    // caller's capacity.
    let lens: Vec<usize> = (0..items.len())
        .map(|i| match &leases[i] {
            Some(lease) => lease.len(),
            None if results[i].is_err() => 0,
            None => match known[i] {
                KnownLen::Len(len) => len.min(capacities[i]),
                KnownLen::Absent => 0,
                KnownLen::Unknown => room.min(capacities[i]),
            },
        })
        .collect();
    let total: u64 = lens.iter().map(|&l| l as u64).sum();
    if total + 16 * items.len() as u64 > max_frame {
        return Reply::error(
            code::LIMIT,
            format!("the values ({total} bytes) exceed the frame limit; use smaller batches"),
        );
    }
    let slot_of = |len: usize| len.div_ceil(4096) * 4096;
    // What is staged comes from what the store holds, not from what the
    // request names: a key known absent gets no slot (it is still asked
    // for, with an empty destination, so the store counts its miss), and a
    // key named again (with the same capacity) is read once and sent from
    // the first one's slot.
    let mut first_of: HashMap<(&[u8], u64), usize> = HashMap::new();
    let mut same_as: Vec<Option<usize>> = vec![None; items.len()];
    let mut to_read: Vec<usize> = Vec::new();
    let mut absent: Vec<usize> = Vec::new();
    for &i in &unleased {
        if results[i].is_err() {
            continue; // known too small for its room: answered above
        }
        if matches!(known[i], KnownLen::Absent) {
            absent.push(i);
            continue;
        }
        match first_of.entry((keys[i], items[i].1)) {
            std::collections::hash_map::Entry::Occupied(first) => same_as[i] = Some(*first.get()),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(i);
                to_read.push(i);
            }
        }
    }
    let mut slot_at: Vec<Option<usize>> = vec![None; items.len()];
    let mut needed = 0usize;
    for &i in &to_read {
        slot_at[i] = Some(needed);
        needed += slot_of(lens[i].max(1));
    }
    let needed = needed.max(1);
    if arena.as_ref().is_none_or(|a| a.len() < needed) {
        // The old arena goes first: the budget counts the new one alone.
        *arena = None;
        if !grant(needed) {
            leases.clear();
            return Reply::error(code::LIMIT, spent());
        }
        *arena = Some(AlignedBuf::zeroed(needed));
    }
    let arena = arena.as_mut().expect("sized above");
    if !to_read.is_empty() || !absent.is_empty() {
        let mut rest = arena.as_mut_slice();
        let mut slices: Vec<[&mut [u8]; 1]> = Vec::with_capacity(to_read.len() + absent.len());
        for &i in &to_read {
            let (slot, tail) = rest.split_at_mut(slot_of(lens[i].max(1)));
            // The caller's capacity bounds what is returned.
            let limit = (items[i].1 as usize).min(slot.len());
            slices.push([&mut slot[..limit]]);
            rest = tail;
        }
        for _ in &absent {
            slices.push([&mut []]);
        }
        let mut dests: Vec<&mut [&mut [u8]]> = slices.iter_mut().map(|s| &mut s[..]).collect();
        let read_keys: Vec<&[u8]> = to_read.iter().chain(&absent).map(|&i| keys[i]).collect();
        let answers = per_key(backend.batch_get(&read_keys, &mut dests), read_keys.len());
        for (n, (&i, result)) in to_read.iter().chain(&absent).zip(answers).enumerate() {
            results[i] = match result {
                // Absent at the length lookup, or shorter there than the
                // caller's room, and put since: this get came first, and
                // it is a miss.
                Err(e)
                    if e.kind() == kvtier::ErrorKind::BufferTooSmall
                        && (n >= to_read.len() || lens[i] < capacities[i].min(room)) =>
                {
                    Ok(None)
                }
                result => result,
            };
        }
    }
    for i in 0..items.len() {
        if let Some(first) = same_as[i] {
            results[i] = match &results[first] {
                Ok(found) => Ok(*found),
                Err(e) => Err(e.duplicate()),
            };
            slot_at[i] = slot_at[first];
        }
    }
    let needed = too_small_lens(backend, &keys, &results, &learned);
    let (w, bytes_out) = get_table(&results, |i| needed[i]);
    let arena: &'b AlignedBuf = arena;
    let leases: &'b [Option<ValueLease>] = leases;
    let mut tail = Vec::new();
    for (i, (result, lease)) in results.iter().zip(leases.iter()).enumerate() {
        let Ok(Some(n)) = result else {
            continue;
        };
        match (lease, slot_at[i]) {
            (Some(lease), _) => tail.push(&lease.bytes()[..*n]),
            (None, Some(offset)) => tail.push(&arena.as_slice()[offset..offset + n]),
            // A hit has a lease or a slot.
            (None, None) => unreachable!("a hit without a lease or a slot"),
        }
    }
    get_reply(w, bytes_out, tail, &results)
}

/// A batch get's reply: the per-key table (`get_table`), then the values
/// of the hits in `tail`.
pub(crate) fn get_reply<'b>(
    table: Writer,
    bytes_out: u64,
    tail: Vec<&'b [u8]>,
    results: &[kvtier::Result<Option<usize>>],
) -> Reply<'b> {
    Reply {
        tail,
        ..Reply::ok(table.buf).with_sample(Sample {
            keys: results.len() as u64,
            bytes_out,
            error: results.iter().any(|r| r.is_err()),
            ..Sample::default()
        })
    }
}

pub(crate) fn batch_exists<'b>(backend: &dyn KvBackend, keys: &[&[u8]]) -> Reply<'b> {
    match backend.batch_exists(keys) {
        Ok(present) => exists_reply(&present),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// The reply to a BatchExists: `u32 n, n × u8`.
pub(crate) fn exists_reply<'b>(present: &[bool]) -> Reply<'b> {
    let mut w = Writer::with_capacity(4 + present.len());
    w.u32(present.len() as u32);
    for &p in present {
        w.u8(u8::from(p));
    }
    Reply::ok(w.buf).with_sample(Sample {
        keys: present.len() as u64,
        ..Sample::default()
    })
}

pub(crate) fn prefix_len<'b>(backend: &dyn KvBackend, keys: &[&[u8]]) -> Reply<'b> {
    match backend.prefix_len(keys) {
        Ok(leading) => prefix_reply(leading, keys.len()),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// The reply to a PrefixLen over `keys` keys: `u64` leading keys present.
pub(crate) fn prefix_reply<'b>(leading: usize, keys: usize) -> Reply<'b> {
    let mut w = Writer::default();
    w.u64(leading as u64);
    Reply::ok(w.buf).with_sample(Sample {
        keys: keys as u64,
        ..Sample::default()
    })
}

pub(crate) fn remove<'b>(backend: &dyn KvBackend, key: &[u8]) -> Reply<'b> {
    match backend.remove(key) {
        Ok(removed) => Reply::ok(vec![u8::from(removed)]),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

pub(crate) fn flush<'b>(backend: &dyn KvBackend) -> Reply<'b> {
    match backend.flush() {
        Ok(()) => Reply::ok(Vec::new()),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// One value's `(offset, len)` ranges of a registered buffer: one range
/// (the single-range ops) or the ranges a segment op's frame holds, read
/// from the frame where they lie (no decoded copy of millions of them).
pub(crate) trait ValueRanges {
    /// How many ranges.
    fn count(&self) -> usize;
    /// Range `i`.
    fn range(&self, i: usize) -> (u64, u64);
    /// The ranges as foreign segments of `region` (`None`: one leaves it).
    fn foreign(&self, region: &SharedRegion) -> Option<ForeignSegments>;
}

impl<T: ValueRanges> ValueRanges for &T {
    fn count(&self) -> usize {
        (*self).count()
    }

    fn range(&self, i: usize) -> (u64, u64) {
        (*self).range(i)
    }

    fn foreign(&self, region: &SharedRegion) -> Option<ForeignSegments> {
        (*self).foreign(region)
    }
}

impl ValueRanges for [(u64, u64); 1] {
    fn count(&self) -> usize {
        1
    }

    fn range(&self, _: usize) -> (u64, u64) {
        self[0]
    }

    fn foreign(&self, region: &SharedRegion) -> Option<ForeignSegments> {
        region.foreign_segments(self)
    }
}

impl ValueRanges for kvtier_wire::protocol::SegmentList<'_> {
    fn count(&self) -> usize {
        self.len()
    }

    fn range(&self, i: usize) -> (u64, u64) {
        self.get(i)
    }

    fn foreign(&self, region: &SharedRegion) -> Option<ForeignSegments> {
        region.foreign_segments_in(self)
    }
}

/// Whether any two non-empty ranges of `items` overlap. Ranges laid out
/// in ascending order (as a client that lays its blocks out in order sends
/// them) are checked in one pass with no memory. Otherwise this costs 4
/// bytes a range where the buffer is under 4 GiB, 8 above (the ranges'
/// starts, sorted; each range then finds its own start and checks that the
/// next one lies past its end), never a copy of the ranges themselves: a
/// frame of 16 M ranges stays within 1.5x of its size.
/// Whether any two non-empty ranges of the items marked `usable` overlap
/// (see `ranges_overlap`); the others fail alone, unchecked.
pub(crate) fn usable_ranges_overlap<S: ValueRanges>(
    items: &[(&[u8], S)],
    usable: &[bool],
    buffer_len: usize,
) -> bool {
    let checked: Vec<(&[u8], &S)> = items
        .iter()
        .zip(usable)
        .filter(|(_, &usable)| usable)
        .map(|((k, s), _)| (*k, s))
        .collect();
    ranges_overlap(&checked, buffer_len)
}

fn ranges_overlap<S: ValueRanges>(items: &[(&[u8], S)], buffer_len: usize) -> bool {
    let ranges = || {
        items
            .iter()
            .flat_map(|(_, s)| (0..s.count()).map(move |i| s.range(i)))
            .filter(|&(_, len)| len > 0)
    };
    let mut end = 0u64;
    let ascending = ranges().all(|(offset, len)| {
        let ok = offset >= end;
        end = offset.saturating_add(len);
        ok
    });
    if ascending {
        return false;
    }
    fn check<T: Ord + Copy + TryFrom<u64>>(
        ranges: impl Iterator<Item = (u64, u64)> + Clone,
    ) -> bool {
        let narrow = |v: u64| T::try_from(v).ok();
        let mut starts: Vec<T> = Vec::with_capacity(ranges.clone().count());
        for (offset, _) in ranges.clone() {
            // Ranges were checked inside the buffer, whose offsets fit T.
            let Some(start) = narrow(offset) else {
                return true;
            };
            starts.push(start);
        }
        starts.sort_unstable();
        ranges.into_iter().any(|(offset, len)| {
            let Some(start) = narrow(offset) else {
                return true;
            };
            // The first start at or past this one is this range's own (or
            // an equal one's: then the next is equal too, and inside).
            let own = starts.partition_point(|&s| s < start);
            match starts.get(own + 1) {
                Some(&next) => narrow(offset.saturating_add(len)).is_none_or(|end| next < end),
                None => false,
            }
        })
    }
    if u32::try_from(buffer_len).is_ok() {
        check::<u32>(ranges())
    } else {
        check::<u64>(ranges())
    }
}

/// Puts values gathered from `(offset, len)` segments of a registered
/// buffer (the single-range op passes one segment per value). The client
/// may write its buffer at any time, so its bytes are reached only through
/// raw copies (`kvtier::ForeignSegments`): straight into the pool when the
/// backend is the store, else first into a private copy taken from the
/// buffer budget (`grant`; past it the request is answered LIMIT).
pub(crate) fn batch_put_shm<'b, S: ValueRanges>(
    backend: &dyn KvBackend,
    region: &SharedRegion,
    flags: u8,
    items: &[(&[u8], S)],
    grant: &mut dyn FnMut(usize) -> bool,
    spent: &dyn Fn() -> String,
) -> Reply<'b> {
    let mut codes = vec![code::OK; items.len()];
    let mut keys = Vec::with_capacity(items.len());
    let mut values: Vec<ForeignSegments> = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for (i, (key, segments)) in items.iter().enumerate() {
        match segments.foreign(region) {
            Some(value) => {
                keys.push(*key);
                values.push(value);
                slots.push(i);
            }
            None => codes[i] = code::INVALID_ARGUMENT,
        }
    }
    let options = put_flags::decode(flags);
    let bytes_in: u64 = values.iter().map(|v| v.len() as u64).sum();
    let results = match backend.as_store() {
        Some(store) => store.batch_put_foreign(&keys, &values, &options),
        None => {
            let total = usize::try_from(bytes_in).unwrap_or(usize::MAX);
            if !grant(total) {
                return Reply::error(code::LIMIT, spent());
            }
            let copies: Vec<Vec<u8>> = values
                .iter()
                .map(|v| {
                    let mut copy = vec![0u8; v.len()];
                    v.copy_out(0, &mut copy);
                    copy
                })
                .collect();
            let parts: Vec<[&[u8]; 1]> = copies.iter().map(|c| [&c[..]]).collect();
            let refs: Vec<&[&[u8]]> = parts.iter().map(|p| &p[..]).collect();
            per_key(backend.batch_put(&keys, &refs, &options), keys.len())
        }
    };
    for (slot, result) in slots.into_iter().zip(&results) {
        codes[slot] = result_code(result);
    }
    put_reply(&codes, bytes_in)
}

/// Private copies of values and each key's read result (see `read_staged`).
pub(crate) type Staged = (Vec<Vec<u8>>, Vec<kvtier::Result<Option<usize>>>);

/// Reads `keys` into private copies for a caller whose memory the backend
/// cannot reach itself: each copy as long as the value where its length is
/// known (none for an absent key), else the caller's room (`capacities`,
/// bounded by `largest`), all taken from the buffer budget (`grant`;
/// `None` past it). Per key the copy and the read's result; a value
/// absent or shorter at the length lookup than the room, put since, is a
/// miss (this get came first).
pub(crate) fn read_staged(
    backend: &dyn KvBackend,
    keys: &[&[u8]],
    capacities: &[usize],
    largest: u64,
    grant: &mut dyn FnMut(usize) -> bool,
) -> Option<Staged> {
    let room = usize::try_from(largest).unwrap_or(usize::MAX);
    let mut known: Vec<KnownLen> = keys.iter().map(|k| backend.known_len(k)).collect();
    learn_unknown_lens(backend, keys, capacities, room, &mut known);
    let sizes: Vec<usize> = known
        .iter()
        .zip(capacities)
        .map(|(known, &capacity)| match known {
            KnownLen::Len(len) => (*len).min(capacity).min(room),
            KnownLen::Absent => 0,
            KnownLen::Unknown => capacity.min(room),
        })
        .collect();
    let total = sizes.iter().fold(0usize, |a, &b| a.saturating_add(b));
    if !grant(total) {
        return None;
    }
    let mut copies: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let mut parts: Vec<[&mut [u8]; 1]> = copies.iter_mut().map(|c| [&mut c[..]]).collect();
    let mut refs: Vec<&mut [&mut [u8]]> = parts.iter_mut().map(|p| &mut p[..]).collect();
    let mut got = per_key(backend.batch_get(keys, &mut refs), keys.len());
    for (i, result) in got.iter_mut().enumerate() {
        if matches!(result, Err(e) if e.kind() == kvtier::ErrorKind::BufferTooSmall
            && sizes[i] < capacities[i].min(room))
        {
            *result = Ok(None);
        }
    }
    Some((copies, got))
}

/// Gets values scattered into `(offset, capacity)` segments of a registered
/// buffer, in order; no two segments of the batch may overlap. Values go
/// in through raw copies only (`kvtier::ForeignSegments`): from the pool
/// or a private, verified disk read when the backend is the store; else
/// through a private copy from the buffer budget (`grant`: each key's room
/// is its capacity bounded by `largest`).
pub(crate) fn batch_get_shm<'b, S: ValueRanges>(
    backend: &dyn KvBackend,
    region: &SharedRegion,
    items: &[(&[u8], S)],
    largest: u64,
    grant: &mut dyn FnMut(usize) -> bool,
    spent: &dyn Fn() -> String,
) -> Reply<'b> {
    // A range outside the buffer fails its own key below; the check of
    // overlaps is among those inside it.
    let inside: Vec<bool> = items
        .iter()
        .map(|(_, s)| {
            (0..s.count()).all(|i| {
                let (offset, len) = s.range(i);
                offset
                    .checked_add(len)
                    .is_some_and(|end| end <= region.len() as u64)
            })
        })
        .collect();
    if usable_ranges_overlap(items, &inside, region.len()) {
        return Reply::error(code::INVALID_ARGUMENT, "destination ranges overlap");
    }
    let mut results: Vec<kvtier::Result<Option<usize>>> = Vec::with_capacity(items.len());
    let mut keys = Vec::with_capacity(items.len());
    let mut dests: Vec<ForeignSegments> = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for (i, (key, segments)) in items.iter().enumerate() {
        // The segments were checked disjoint above.
        match segments.foreign(region) {
            Some(dest) => {
                keys.push(*key);
                dests.push(dest);
                slots.push(i);
                results.push(Ok(None)); // replaced by the read's result
            }
            None => results.push(Err(kvtier::Error::invalid("range outside the buffer"))),
        }
    }
    let got = match backend.as_store() {
        Some(store) => store.batch_get_foreign(&keys, &mut dests),
        None => {
            let capacities: Vec<usize> = dests.iter().map(|d| d.len()).collect();
            let Some((copies, mut got)) = read_staged(backend, &keys, &capacities, largest, grant)
            else {
                return Reply::error(code::LIMIT, spent());
            };
            for (i, result) in got.iter_mut().enumerate() {
                if let Ok(Some(n)) = result {
                    dests[i].copy_in(&copies[i][..*n]);
                }
            }
            got
        }
    };
    for (slot, result) in slots.into_iter().zip(got) {
        results[slot] = result;
    }
    let all_keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
    let needed = too_small_lens(
        backend,
        &all_keys,
        &results,
        &vec![KnownLen::Unknown; items.len()],
    );
    let (w, bytes_out) = get_table(&results, |i| needed[i]);
    Reply::ok(w.buf).with_sample(Sample {
        keys: items.len() as u64,
        bytes_out,
        error: results.iter().any(|r| r.is_err()),
        ..Sample::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier::{Config, Store};
    use proptest::prelude::*;

    proptest! {
        /// The overlap check agrees with comparing every pair, for ranges
        /// in any order, empty ones, duplicates and ascending runs, in
        /// buffers below and above 4 GiB.
        #[test]
        fn overlap_agrees_with_every_pair(
            lists in proptest::collection::vec(
                proptest::collection::vec((0u64..64, 0u64..6), 0..6), 0..6),
            ascending in any::<bool>(),
            large in any::<bool>(),
        ) {
            let scale: u64 = if large { 1 << 30 } else { 1 };
            let mut lists: Vec<Vec<(u64, u64)>> = lists
                .into_iter()
                .map(|l| l.into_iter().map(|(o, n)| (o * scale, n * scale)).collect())
                .collect();
            if ascending {
                let mut at = 0;
                for list in &mut lists {
                    for range in list.iter_mut() {
                        range.0 += at;
                        at = range.0 + range.1;
                    }
                }
            }
            let encoded: Vec<Vec<u8>> = lists.iter().map(|l| kvtier_wire::protocol::SegmentList::encode(l)).collect();
            let items: Vec<(&[u8], kvtier_wire::protocol::SegmentList<'_>)> = encoded
                .iter()
                .map(|e| (&b"k"[..], kvtier_wire::protocol::SegmentList::new(e).unwrap()))
                .collect();
            let all: Vec<(u64, u64)> = lists.iter().flatten().copied().filter(|r| r.1 > 0).collect();
            let naive = (0..all.len()).any(|i| (0..i).any(|j| {
                let (a, b) = (all[i], all[j]);
                a.0 < b.0 + b.1 && b.0 < a.0 + a.1
            }));
            let buffer = if large { 1usize << 40 } else { 1 << 12 };
            prop_assert_eq!(ranges_overlap(&items, buffer), naive);
        }
    }

    fn value(key: &[u8], len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        kvtier::pattern::fill(key, &mut v);
        v
    }

    /// A batch mixing memory hits (sent from leases), disk hits (read into
    /// the arena), misses and a too-small capacity answers each key as a
    /// plain get would, and the values follow the table in key order.
    #[test]
    fn gets_mix_leased_memory_hits_with_disk_reads_in_key_order() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::new(dir.path())
            .memory_capacity(8 << 20)
            .disk_capacity(64 << 20)
            .region_size(4 << 20);
        let on_disk: Vec<Vec<u8>> = (0..3).map(|i| format!("disk-{i}").into_bytes()).collect();
        {
            let store = Store::open(config.clone()).unwrap();
            for k in &on_disk {
                store.put(k, value(k, 10_000)).unwrap();
            }
            store.close().unwrap();
        }
        // Reopened: those are on disk only; these are in memory.
        let store = Store::open(config).unwrap();
        let in_memory: Vec<Vec<u8>> = (0..3).map(|i| format!("mem-{i}").into_bytes()).collect();
        for k in &in_memory {
            store.put(k, value(k, 20_000)).unwrap();
        }
        let ns = store.default_namespace().clone();
        let view = store.in_namespace(&ns);
        let items: Vec<(&[u8], u64)> = vec![
            (&in_memory[0], 1 << 20),
            (&on_disk[0], 1 << 20),
            (b"missing", 1 << 20),
            (&in_memory[1], 100), // too small
            (&on_disk[1], 1 << 20),
            (&in_memory[2], 1 << 20),
            (&on_disk[2], 100), // too small, on disk: not read
        ];
        let before = store.stats();
        let (mut arena, mut leases) = (None, Vec::new());
        let reply = batch_get(
            &view,
            &items,
            &mut arena,
            &mut leases,
            1 << 30,
            1 << 30,
            &mut |_| true,
            &String::new,
        );
        assert_eq!(reply.status, code::OK);
        let mut r = kvtier_wire::protocol::Reader::new(&reply.body);
        assert_eq!(r.u32().unwrap(), 7);
        let table: Vec<(i32, u64)> = (0..7)
            .map(|_| (r.i32().unwrap(), r.u64().unwrap()))
            .collect();
        assert_eq!(
            table,
            vec![
                (code::OK, 20_000),
                (code::OK, 10_000),
                (code::NOT_FOUND, 0),
                // The value's length, so the caller can ask again with room.
                (code::BUFFER_TOO_SMALL, 20_000),
                (code::OK, 10_000),
                (code::OK, 20_000),
                (code::BUFFER_TOO_SMALL, 10_000),
            ]
        );
        let expected = [
            value(&in_memory[0], 20_000),
            value(&on_disk[0], 10_000),
            value(&on_disk[1], 10_000),
            value(&in_memory[2], 20_000),
        ];
        assert_eq!(reply.tail.len(), expected.len());
        for (sent, want) in reply.tail.iter().zip(&expected) {
            assert_eq!(*sent, &want[..]);
        }
        drop(reply);
        let after = store.stats();
        assert_eq!(after.memory_hits - before.memory_hits, 2);
        assert_eq!(after.disk_hits - before.disk_hits, 2);
    }
}
