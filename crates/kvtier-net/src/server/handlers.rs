//! One plain function per operation: a store seen through the
//! connection's namespace and a decoded request in, a reply out. Nothing
//! here knows about sockets, sessions or limits other than those passed in.

use crate::metrics::Sample;
use crate::protocol::{code, put_flags, Writer};
use crate::shm::SharedRegion;
use kvtier::disk::io::AlignedBuf;
use kvtier::{NamespacedStore, PutOptions, PutTier};

/// A request's reply: frame status, body, and value bytes sent after it.
#[derive(Debug)]
pub(crate) struct Reply<'b> {
    pub status: i32,
    pub body: Vec<u8>,
    pub tail: Vec<&'b [u8]>,
    pub sample: Sample,
    /// Close the connection after sending.
    pub close: bool,
}

impl<'b> Reply<'b> {
    pub fn ok(body: Vec<u8>) -> Self {
        Reply {
            status: code::OK,
            body,
            tail: Vec::new(),
            sample: Sample::default(),
            close: false,
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
        }
    }

    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    fn with_sample(mut self, sample: Sample) -> Self {
        self.sample = sample;
        self
    }
}

fn result_code<T>(result: &kvtier::Result<T>) -> i32 {
    match result {
        Ok(_) => code::OK,
        Err(e) => code::of(e.kind()),
    }
}

pub(crate) fn put_options(flags: u8) -> PutOptions {
    PutOptions {
        skip_existing: flags & put_flags::SKIP_EXISTING != 0,
        tier: if flags & put_flags::MEMORY_ONLY != 0 {
            PutTier::MemoryOnly
        } else {
            PutTier::MemoryAndDisk
        },
        durable: flags & put_flags::DURABLE != 0,
    }
}

/// The reply to a batch put: a code per key.
fn put_reply<'b>(codes: &[i32], bytes_in: u64) -> Reply<'b> {
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

/// The per-key table of a batch get: `u32 n, n × (i32 code, u64 len)`.
fn get_table(results: &[kvtier::Result<Option<usize>>]) -> (Writer, u64) {
    let mut w = Writer::with_capacity(4 + 12 * results.len());
    w.u32(results.len() as u32);
    let mut bytes_out = 0;
    for result in results {
        match result {
            Ok(Some(n)) => {
                w.i32(code::OK).u64(*n as u64);
                bytes_out += *n as u64;
            }
            Ok(None) => {
                w.i32(code::NOT_FOUND).u64(0);
            }
            Err(e) => {
                w.i32(code::of(e.kind())).u64(0);
            }
        }
    }
    (w, bytes_out)
}

pub(crate) fn batch_put<'b>(
    store: NamespacedStore<'_>,
    flags: u8,
    items: &[(&[u8], &[u8])],
) -> Reply<'b> {
    let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
    let values: Vec<&[u8]> = items.iter().map(|i| i.1).collect();
    let results = store.batch_put_with(&keys, &values, &put_options(flags));
    let codes: Vec<i32> = results.iter().map(result_code).collect();
    put_reply(&codes, values.iter().map(|v| v.len() as u64).sum())
}

/// Values come back after the per-key table, straight from page-aligned
/// slots of `arena` that the disk reads land in (no copy into a reply).
/// `arena` is the connection's, grown here when needed.
pub(crate) fn batch_get<'b>(
    store: NamespacedStore<'_>,
    items: &[(&[u8], u64)],
    arena: &'b mut Option<AlignedBuf>,
    max_frame: u64,
) -> Reply<'b> {
    let lens: Vec<usize> = items
        .iter()
        .map(|(key, cap)| {
            store
                .value_len(key)
                .ok()
                .flatten()
                .map_or(0, |l| l.min(*cap as usize))
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
    let needed = lens
        .iter()
        .map(|&l| slot_of(l.max(1)))
        .sum::<usize>()
        .max(1);
    if arena.as_ref().is_none_or(|a| a.len() < needed) {
        *arena = Some(AlignedBuf::zeroed(needed));
    }
    let arena = arena.as_mut().expect("sized above");
    let results = {
        let mut rest = arena.as_mut_slice();
        let mut slices: Vec<&mut [u8]> = Vec::with_capacity(items.len());
        for (&len, (_, cap)) in lens.iter().zip(items) {
            let (slot, tail) = rest.split_at_mut(slot_of(len.max(1)));
            // The caller's capacity bounds what is returned.
            let limit = (*cap as usize).min(slot.len());
            slices.push(&mut slot[..limit]);
            rest = tail;
        }
        let keys: Vec<&[u8]> = items.iter().map(|i| i.0).collect();
        store.batch_get_into(&keys, &mut slices)
    };
    let (w, bytes_out) = get_table(&results);
    let arena: &'b AlignedBuf = arena;
    let mut tail = Vec::new();
    let mut offset = 0usize;
    for (result, &len) in results.iter().zip(&lens) {
        if let Ok(Some(n)) = result {
            tail.push(&arena.as_slice()[offset..offset + n]);
        }
        offset += slot_of(len.max(1));
    }
    Reply {
        tail,
        ..Reply::ok(w.buf).with_sample(Sample {
            keys: items.len() as u64,
            bytes_out,
            error: results.iter().any(|r| r.is_err()),
            ..Sample::default()
        })
    }
}

pub(crate) fn batch_exists<'b>(store: NamespacedStore<'_>, keys: &[&[u8]]) -> Reply<'b> {
    let present = store.batch_exists(keys);
    let mut w = Writer::with_capacity(4 + present.len());
    w.u32(present.len() as u32);
    for p in present {
        w.u8(u8::from(p));
    }
    Reply::ok(w.buf).with_sample(Sample {
        keys: keys.len() as u64,
        ..Sample::default()
    })
}

pub(crate) fn prefix_len<'b>(store: NamespacedStore<'_>, keys: &[&[u8]]) -> Reply<'b> {
    let mut w = Writer::default();
    w.u64(store.prefix_len(keys) as u64);
    Reply::ok(w.buf).with_sample(Sample {
        keys: keys.len() as u64,
        ..Sample::default()
    })
}

pub(crate) fn remove<'b>(store: NamespacedStore<'_>, key: &[u8]) -> Reply<'b> {
    match store.remove(key) {
        Ok(removed) => Reply::ok(vec![u8::from(removed)]),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

pub(crate) fn flush<'b>(store: &kvtier::Store) -> Reply<'b> {
    match store.flush() {
        Ok(()) => Reply::ok(Vec::new()),
        Err(e) => Reply::error(code::of(e.kind()), e.to_string()),
    }
}

/// Puts values gathered from `(offset, len)` segments of a registered
/// buffer (the single-range op passes one segment per value).
pub(crate) fn batch_put_shm<'b, S: AsRef<[(u64, u64)]>>(
    store: NamespacedStore<'_>,
    region: &SharedRegion,
    flags: u8,
    items: &[(&[u8], S)],
) -> Reply<'b> {
    let mut codes = vec![code::OK; items.len()];
    let mut keys = Vec::with_capacity(items.len());
    let mut values: Vec<Vec<&[u8]>> = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for (i, (key, segments)) in items.iter().enumerate() {
        let key: &[u8] = key;
        let gathered: Option<Vec<&[u8]>> = segments
            .as_ref()
            .iter()
            .map(|&(offset, len)| region.range(offset, len))
            .collect();
        match gathered {
            Some(parts) => {
                keys.push(key);
                values.push(parts);
                slots.push(i);
            }
            None => codes[i] = code::INVALID_ARGUMENT,
        }
    }
    let refs: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
    let results = store.batch_put_segments(&keys, &refs, &put_options(flags));
    for (slot, result) in slots.into_iter().zip(&results) {
        codes[slot] = result_code(result);
    }
    let bytes_in = values.iter().flatten().map(|v| v.len() as u64).sum();
    put_reply(&codes, bytes_in)
}

/// Gets values scattered into `(offset, capacity)` segments of a registered
/// buffer, in order; no two segments of the batch may overlap.
pub(crate) fn batch_get_shm<'b, S: AsRef<[(u64, u64)]>>(
    store: NamespacedStore<'_>,
    region: &SharedRegion,
    items: &[(&[u8], S)],
) -> Reply<'b> {
    let mut all: Vec<(u64, u64)> = items
        .iter()
        .flat_map(|(_, s)| s.as_ref().iter().copied())
        .collect();
    all.sort_unstable();
    for pair in all.windows(2) {
        if pair[0].0.saturating_add(pair[0].1) > pair[1].0 {
            return Reply::error(code::INVALID_ARGUMENT, "destination ranges overlap");
        }
    }
    let mut results: Vec<kvtier::Result<Option<usize>>> = Vec::with_capacity(items.len());
    let mut keys = Vec::with_capacity(items.len());
    let mut dests: Vec<Vec<&mut [u8]>> = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for (i, (key, segments)) in items.iter().enumerate() {
        let key: &[u8] = key;
        // SAFETY: segments were checked disjoint above, and the client does
        // not touch them until this reply arrives (a client that does
        // anyway only garbles its own bytes: the memfd is sealed against
        // shrinking, so no access can fault).
        let scattered: Option<Vec<&mut [u8]>> = segments
            .as_ref()
            .iter()
            .map(|&(offset, cap)| unsafe { region.range_mut(offset, cap) })
            .collect();
        match scattered {
            Some(parts) => {
                keys.push(key);
                dests.push(parts);
                slots.push(i);
                results.push(Ok(None)); // replaced by the read's result
            }
            None => results.push(Err(kvtier::Error::invalid("range outside the buffer"))),
        }
    }
    let mut refs: Vec<&mut [&mut [u8]]> = dests.iter_mut().map(|d| &mut d[..]).collect();
    let got = store.batch_get_segments(&keys, &mut refs);
    for (slot, result) in slots.into_iter().zip(got) {
        results[slot] = result;
    }
    let (w, bytes_out) = get_table(&results);
    Reply::ok(w.buf).with_sample(Sample {
        keys: items.len() as u64,
        bytes_out,
        error: results.iter().any(|r| r.is_err()),
        ..Sample::default()
    })
}
