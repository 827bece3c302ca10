//! `Store`: the embedded store, and how its recovery findings are logged.

use crate::backend::Backend;
use crate::convert::{parse_size, to_py_err};
use crate::engine::Engine;
use crate::registry::Registered;
use kvtier::{Config, EvictionPolicy, IoEngineKind, Store};
use pyo3::prelude::*;
use std::sync::Arc;

/// The embedded store, in this process: `Store(path, memory="1GiB",
/// disk="16GiB", *, namespace="", region_size=None, io_engine="uring",
/// eviction="s3fifo", max_value_size="128MiB", shared_dir=None)`. Sizes are
/// bytes or strings like "64MiB". Every key lives in `namespace`. With
/// `shared_dir`, the disk tier's log lives in that directory of a file
/// system every node mounts, and every node's flushed blocks are read there
/// (docs/design.md, "Shared directory").
#[pyclass(extends = Engine, name = "Store", module = "kvtier._native")]
pub(crate) struct Store_;

#[pymethods]
impl Store_ {
    #[new]
    #[pyo3(signature = (path, memory=None, disk=None, *, namespace="", region_size=None, io_engine=None, eviction=None, max_value_size=None, shared_dir=None))]
    #[expect(
        clippy::too_many_arguments,
        reason = "the store's settings as keyword arguments"
    )]
    pub(crate) fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        memory: Option<&Bound<'_, PyAny>>,
        disk: Option<&Bound<'_, PyAny>>,
        namespace: &str,
        region_size: Option<&Bound<'_, PyAny>>,
        io_engine: Option<String>,
        eviction: Option<String>,
        max_value_size: Option<&Bound<'_, PyAny>>,
        shared_dir: Option<std::path::PathBuf>,
    ) -> PyResult<PyClassInitializer<Self>> {
        // The defaults are the core's, as `kvtier serve`'s are (1 GiB of
        // memory, 16 GiB of disk): a directory opened by either keeps its
        // capacity instead of being reclaimed down to the other's default.
        let mut config = Config::new(path).namespace(namespace);
        if let Some(memory) = memory {
            config = config.memory_capacity(parse_size(memory)?);
        }
        if let Some(disk) = disk {
            config = config.disk_capacity(parse_size(disk)?);
        }
        if let Some(r) = region_size {
            config = config.region_size(parse_size(r)?);
        }
        if let Some(e) = io_engine {
            config = config.io_engine(IoEngineKind::parse(&e).map_err(to_py_err)?);
        }
        if let Some(p) = eviction {
            config = config.eviction(EvictionPolicy::parse(&p).map_err(to_py_err)?);
        }
        if let Some(v) = max_value_size {
            config = config.max_value_size(parse_size(v)?);
        }
        if let Some(dir) = shared_dir {
            config = config.shared_dir(dir);
        }
        let store = py.detach(|| Store::open(config)).map_err(to_py_err)?;
        log_recovery(py, &store)?;
        let engine = Engine {
            backend: Arc::new(Backend::new(Arc::new(store))),
            registered: Registered::default(),
        };
        Ok(PyClassInitializer::from(engine).add_subclass(Store_))
    }
}

/// Says through Python's `logging` (logger "kvtier", level WARNING) what
/// the open found and decided that an operator must know: the server logs
/// the same through its own log, and `stats()` carries the counts.
pub(crate) fn log_recovery(py: Python<'_>, store: &Store) -> PyResult<()> {
    let report = store.recovery_report();
    let stats = store.stats();
    let mut findings = Vec::new();
    let mut note = |n: u64, what: &str| {
        if n > 0 {
            findings.push(format!("{n} {what}"));
        }
    };
    note(
        report.quarantined_regions,
        "region file(s) moved to quarantine/ (unreadable, not regular files, twins or keyed with another secret)",
    );
    note(
        report.damaged_regions,
        "region(s) with damaged pages skipped",
    );
    note(
        report.damaged_headers,
        "region(s) kept despite a damaged header",
    );
    note(
        report.skipped_files,
        "file(s) under region names neither used nor movable",
    );
    note(
        report.buffered_regions,
        "region file(s) that refuse O_DIRECT, read buffered",
    );
    note(
        report.regions_behind_gap,
        "region(s) not indexed because a newer region is missing",
    );
    note(
        report.scrub_dropped,
        "value(s) lost by the device before an unclean shutdown, not indexed",
    );
    if stats.io_engine != "none" && !stats.direct_io {
        findings.push("the data directory's file system refuses O_DIRECT: buffered I/O".into());
    }
    if findings.is_empty() {
        return Ok(());
    }
    let message = format!(
        "kvtier store {}: recovery found {}",
        store.config().data_dir().display(),
        findings.join("; ")
    );
    py.import("logging")?
        .call_method1("getLogger", ("kvtier",))?
        .call_method1("warning", (message,))?;
    Ok(())
}
