//! `kvtier bench`'s arguments (`BenchArgs`, clap) and what they select.

use kvtier::parse_size;
use std::path::PathBuf;

fn parse_sizes(text: &str) -> Result<Vec<u64>, String> {
    text.split(',').map(parse_size).collect()
}

fn parse_list(text: &str) -> Result<Vec<usize>, String> {
    text.split(',')
        .map(|t| t.trim().parse::<usize>().map_err(|e| format!("{t:?}: {e}")))
        .collect()
}

fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim().to_ascii_lowercase();
    let (number, multiplier) = if let Some(n) = t.strip_suffix('m') {
        (n, 1_000_000)
    } else if let Some(n) = t.strip_suffix('k') {
        (n, 1_000)
    } else {
        (t.as_str(), 1)
    };
    number
        .parse::<u64>()
        .map(|n| n * multiplier)
        .map_err(|e| format!("{text:?}: {e}"))
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Directory for the store and the baseline's scratch file; created if
    /// missing and removed afterwards if the bench created it.
    #[arg(long, default_value = "./kvtier-bench-data")]
    pub data_dir: PathBuf,
    /// Value sizes, comma separated.
    #[arg(long, default_value = "16MiB,64MiB", value_parser = parse_sizes)]
    pub value_sizes: std::vec::Vec<u64>,
    /// Keys per batch call, comma separated.
    #[arg(long, default_value = "1,4,8,16", value_parser = parse_list)]
    pub batches: std::vec::Vec<usize>,
    /// Operations: put, get.
    #[arg(long, default_value = "put,get", value_delimiter = ',')]
    pub ops: Vec<String>,
    /// Tiers: memory, disk, shared (the seed's workflow: a prefill store
    /// puts into a shared directory, a decode store reads it through
    /// another mount; needs --shared-mounts).
    #[arg(long, default_value = "memory,disk", value_delimiter = ',')]
    pub tiers: Vec<String>,
    /// With --tiers shared: one directory of a shared file system as the
    /// prefill node's mount and as the decode node's mount shows it
    /// (two mounts of one JuiceFS volume, say: `scripts/shared-bench` sets
    /// them up), comma separated.
    #[arg(long, value_delimiter = ',')]
    pub shared_mounts: Vec<PathBuf>,
    /// io engine: uring or psync.
    #[arg(long, default_value = "uring")]
    pub io_engine: String,
    /// With the uring engine: register the memory pool as fixed buffers
    /// and region files as registered files (the store's default), or not.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub io_registration: bool,
    /// Memory pool capacity. Default: 2 GiB; with --trace, a list of
    /// capacities to replay at (default: 3 million tokens' worth of blocks).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub memory: Vec<u64>,
    /// Disk tier capacity. Default: 16 GiB; with --trace, a list where 0
    /// means memory-only and `auto` means room for the whole trace
    /// (default: 0,auto).
    #[arg(long, value_delimiter = ',')]
    pub disk: Vec<String>,
    /// Memory eviction policies (lru, s3fifo, adaptive; `default` is the
    /// store's default, adaptive). Default: the store's; with --trace or
    /// --workload, each is replayed (default: lru,s3fifo,default).
    #[arg(long, value_delimiter = ',')]
    pub eviction: Vec<String>,
    /// Run the cases through the client against a running server
    /// (`unix:///path/kvtier.sock` or `tcp://host:port`); the token comes
    /// from KVTIER_AUTH_TOKEN.
    #[arg(long)]
    pub connect: Option<String>,
    /// With --connect: the server's data directory, readable by the bench
    /// (run beside the server): disk gets are then compared with raw reads
    /// of the server's own region files instead of a scratch file's.
    #[arg(long, requires = "connect")]
    pub server_data_dir: Option<PathBuf>,
    /// With --connect to a cluster member: send each key straight to the
    /// members that own it (client-side routing, one hop) instead of
    /// through the connected server.
    #[arg(long, requires = "connect")]
    pub route: bool,
    /// Replay a request trace (JSON lines with `hash_ids`, as Mooncake's
    /// FAST'25 traces) instead of the synthetic cases.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replay synthesised workloads instead of a trace file, each in turn:
    /// conversation, agent, rag (docs/benchmarks.md describes each). The
    /// --trace options apply.
    #[arg(long, value_delimiter = ',', conflicts_with = "trace")]
    pub workload: Vec<String>,
    /// With --workload: requests per workload.
    #[arg(long, default_value_t = 20_000)]
    pub workload_requests: usize,
    /// With --workload: the generator's seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// With --workload: write each generated trace here as Mooncake-format
    /// JSON lines (`PATH` gets the workload's name before its extension)
    /// and replay nothing.
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
    /// With --trace: memory capacities given in tokens (1M, 3M, ...),
    /// each turned into whole blocks of the trace's value size.
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    pub memory_tokens: Vec<u64>,
    /// With --trace: KV bytes per token; a block of 512 tokens is a value
    /// of 512 times this.
    #[arg(long, default_value_t = 128)]
    pub bytes_per_token: u64,
    /// With --trace: replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// With --trace: replay arrival times N times faster (default: as fast
    /// as possible).
    #[arg(long, conflicts_with = "max_rate")]
    pub speed: Option<f64>,
    /// With --trace: ignore arrival times and replay as fast as possible
    /// (the default).
    #[arg(long)]
    pub max_rate: bool,
    /// The store's io_uring queue depth (`Config::io_depth`).
    #[arg(long, default_value_t = 64)]
    pub io_depth: u32,
    /// The store's disk read piece (`Config::read_piece`).
    #[arg(long, default_value = "2MiB", value_parser = parse_size)]
    pub read_piece: u64,
    /// Disk get cases: batch calls each caller keeps in flight (what the
    /// async calls give one caller: the next batch is issued while one is
    /// read). Each call in flight runs on its own worker, and with more than
    /// one the raw shape-matched side keeps as many calls in flight too.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Run every case this many times, each on fresh files (or, with
    /// --connect, fresh keys), and report each figure's median with its
    /// min and max (synthetic cases; not --trace or --workload).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Bytes each case moves (rounded to whole batches, at least one).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub bytes_per_case: u64,
    /// Caller threads issuing batches concurrently in store cases.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Also measure batch_exists of 1,024 keys on an index of this many
    /// entries (e.g. 10M); 0 skips it.
    #[arg(long, default_value = "0", value_parser = parse_count)]
    pub index_entries: u64,
    /// Also measure reopening a store holding this many entries (e.g. 1M,
    /// 4 KiB each); 0 skips it.
    #[arg(long, default_value = "0", value_parser = parse_count)]
    pub reopen_entries: u64,
    /// Also measure a node starting beside another writer's log of this
    /// many blocks in a shared directory, by reading its records and by
    /// loading its index checkpoint (e.g. 1M,10M); none by default.
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    pub follow_entries: Vec<u64>,
    /// Write the rows as a JSON array to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw throughput against batch count to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the rows as a Markdown table to this file.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Run nothing: read rows saved earlier with --json and write the
    /// --markdown and --plot outputs from them.
    #[arg(long)]
    pub from_json: Option<PathBuf>,
}

pub(crate) fn wants(args: &BenchArgs, op: &str, tier: &str) -> bool {
    args.ops.iter().any(|o| o == op) && args.tiers.iter().any(|t| t == tier)
}
