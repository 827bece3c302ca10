//! The `kvtier` command-line tool.

mod cluster;
mod demo;
mod namespaces;
mod serve;
mod shared;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "kvtier",
    version,
    about = "A tiered KV-cache store for LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write, read back and verify a synthetic prompt's KV blocks in an
    /// embedded store (memory pool plus disk tier).
    Demo(demo::DemoArgs),
    /// Serve the store to engine processes over TCP and a Unix socket, with
    /// admin HTTP.
    Serve(Box<serve::ServeArgs>),
    /// Measure throughput and latency against raw-device and memcpy
    /// baselines run in the same process (the `bench` build feature, on by
    /// default).
    #[cfg(feature = "bench")]
    Bench(Box<kvtier_bench::BenchArgs>),
    /// Cluster mode: show a cluster's members (needs the `cluster` build
    /// feature).
    Cluster(cluster::ClusterCommand),
    /// Shared directories: collect the logs of writers that died.
    Shared(shared::SharedCommand),
    /// A running server's namespaces: list them (blocks, bytes, manifest,
    /// last use) or retire one whole.
    Namespaces(namespaces::NamespacesCommand),
}

/// Log level from RUST_LOG (one of error, warn, info, debug, trace).
/// Default: warn.
fn init_logging() {
    let level = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::WARN);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "bench")]
        Command::Bench(args) => kvtier_bench::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Cluster(command) => cluster::run(command),
        Command::Shared(command) => shared::run(command),
        Command::Namespaces(command) => namespaces::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}
