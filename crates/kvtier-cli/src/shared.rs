//! `kvtier shared gc`: reclaims the logs of a shared directory's writers
//! that died for good (docs/design.md, "Dead writers"). Without cluster
//! mode nothing adopts a dead node's log by itself; this is the operator's
//! tool for it (cron it, or run it after retiring a node).

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct SharedCommand {
    #[command(subcommand)]
    pub command: SharedSubcommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum SharedSubcommand {
    /// Reclaim the log of every writer that has not changed for
    /// --older-than and whose writer lock no process holds: its regions
    /// are removed (removals another log may still need are kept), and its
    /// directory too when nothing is left.
    Gc(GcArgs),
}

#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// The shared directory (as `kvtier serve --shared-dir` names it on
    /// this host).
    #[arg(long)]
    pub shared_dir: PathBuf,
    /// How long a writer's log must have been unchanged: seconds, or a
    /// number with s, m, h or d (e.g. 6h). No default: say it.
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// Scratch directory for the collector's throwaway data directories.
    /// Default: the system's temporary directory.
    #[arg(long)]
    pub scratch: Option<PathBuf>,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((at, _)) => text.split_at(at),
        None => (text, "s"),
    };
    let scale = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => return Err(format!("{text}: the unit must be s, m, h or d")),
    };
    number
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|n| Duration::try_from_secs_f64(n * scale).ok())
        .ok_or_else(|| format!("{text} is not a duration"))
}

pub fn run(command: &SharedCommand) -> Result<(), Box<dyn std::error::Error>> {
    let SharedSubcommand::Gc(args) = &command.command;
    let scratch = args
        .scratch
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("kvtier-gc-{}", std::process::id())));
    kvtier::private_files::create_dir(&scratch)?;
    let collected = kvtier::collect_dead_writers(&args.shared_dir, args.older_than, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    let mut failed = 0;
    for writer in collected? {
        let idle = writer.idle_seconds;
        let what = match &writer.outcome {
            kvtier::Collection::Recent => format!("changed {idle} s ago: left alone"),
            kvtier::Collection::Alive => "its writer holds its lock: alive, left alone".to_string(),
            kvtier::Collection::Collected {
                regions,
                bytes,
                kept_removals,
                directory_removed,
            } => format!(
                "idle {idle} s: reclaimed {regions} regions ({}), kept {kept_removals} removals \
                 other logs may need{}",
                kvtier::format_size(*bytes),
                if *directory_removed {
                    ", directory removed"
                } else {
                    ""
                }
            ),
            kvtier::Collection::Failed(why) => {
                failed += 1;
                format!("failed: {why}")
            }
        };
        println!("{}: {what}", writer.node);
    }
    if failed > 0 {
        return Err(format!("{failed} writer logs could not be collected").into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_or_without_a_unit() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("6h").unwrap(), Duration::from_secs(6 * 3600));
        assert_eq!(
            parse_duration("2d").unwrap(),
            Duration::from_secs(2 * 86_400)
        );
        assert!(parse_duration("5w").is_err());
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("h").is_err());
    }
}
