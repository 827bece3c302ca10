//! The body of a STATS reply's `store` object: every field of
//! [`kvtier::Stats`], by name, from the core's one field list.

use kvtier::{StatValue, Stats};

pub fn stats_json(stats: &Stats) -> serde_json::Value {
    let fields = stats
        .fields()
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                StatValue::Count(n) => serde_json::Value::from(n),
                StatValue::Flag(b) => serde_json::Value::from(b),
                StatValue::Name(s) => serde_json::Value::from(s),
            };
            (name.to_string(), value)
        })
        .collect();
    serde_json::Value::Object(fields)
}

/// One namespace of a listing (the NAMESPACES reply, `kvtier namespaces`,
/// an embedded store's `namespaces()`): its census, its manifest as JSON
/// (a manifest that is not JSON is shown as unreadable, never dropped),
/// and when the server last served it (`None`: not since it started, or
/// not a server).
pub fn namespace_json(
    census: &kvtier::NamespaceCensus,
    last_used_unix_s: Option<u64>,
) -> serde_json::Value {
    let manifest = census.manifest.as_deref().map(|bytes| {
        serde_json::from_slice::<serde_json::Value>(bytes)
            .unwrap_or_else(|e| serde_json::json!({ "unreadable": format!("not JSON: {e}") }))
    });
    serde_json::json!({
        "name": census.name,
        "blocks": census.blocks,
        "bytes": census.bytes,
        "memory_only_blocks": census.memory_only_blocks,
        "manifest": manifest,
        "last_used_unix_s": last_used_unix_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of `Stats` is in the JSON, once, under its own name
    /// (the `Debug` form names every field, so a field added to the
    /// struct but not to `Stats::fields` fails here).
    #[test]
    fn every_field_is_serialised() {
        let stats = Stats {
            io_engine: "uring",
            eviction_mode: "s3fifo".into(),
            ..Stats::default()
        };
        let json = stats_json(&stats);
        let object = json.as_object().unwrap();
        let debug = format!("{stats:?}");
        let declared = debug.matches(": ").count();
        assert_eq!(object.len(), declared, "{debug}");
        for name in object.keys() {
            assert!(debug.contains(&format!("{name}: ")), "{name}");
        }
        assert_eq!(object["io_engine"], "uring");
        assert_eq!(object["direct_io"], false);
    }
}
