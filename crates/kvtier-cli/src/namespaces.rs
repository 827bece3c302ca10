//! `kvtier namespaces`: what a running server holds per namespace (blocks,
//! bytes, manifest, last use) and the retirement of a whole namespace
//! (docs/integrations.md, "Namespaces an operator can see and retire").
//! A client of the server's protocol, with the credential given: a
//! tenant's token lists and retires its own namespaces only.

use kvtier_client::{Client, ClientOptions};
use serde_json::Value;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct NamespacesCommand {
    /// The server: unix:///path/to.sock, tcp://host:port or tls://host:port.
    /// Default: the socket the README's `kvtier serve` makes,
    /// unix://kvtier-data/kvtier.sock.
    #[arg(long, global = true, default_value = "unix://kvtier-data/kvtier.sock")]
    pub url: String,
    /// The token for a TCP server (the server's or a tenant's). Default:
    /// the KVTIER_AUTH_TOKEN environment variable.
    #[arg(long, global = true, env = "KVTIER_AUTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Seconds to wait for the server's answer (a census reads every
    /// batch record of the server's regions). Default: 300.
    #[arg(long, global = true, default_value_t = 300)]
    pub timeout: u64,
    #[command(subcommand)]
    pub command: NamespacesSubcommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum NamespacesSubcommand {
    /// List the namespaces the credential covers: blocks, bytes, the
    /// manifest's readable fields and when the server last served each.
    List {
        /// Print the server's JSON document instead of a table.
        #[arg(long)]
        json: bool,
        /// The namespace to say hello with (a tenant's token needs one
        /// within its prefixes). Default: "".
        #[arg(long, default_value = "")]
        hello_namespace: String,
    },
    /// Remove every block of one namespace: durable when it returns, on
    /// every member in cluster mode, a Removed event per block. Without
    /// --yes, only says what would be removed.
    Retire {
        /// The namespace, exactly as listed.
        name: String,
        /// Really remove (default: a dry run).
        #[arg(long)]
        yes: bool,
    },
}

fn connect(args: &NamespacesCommand, namespace: &str) -> kvtier::Result<Client> {
    Client::connect_with(
        &args.url,
        ClientOptions {
            auth_token: args.token.clone(),
            namespace: namespace.to_owned(),
            timeout: Duration::from_secs(args.timeout.max(1)),
            ..ClientOptions::default()
        },
    )
}

pub fn run(args: &NamespacesCommand) -> Result<(), Box<dyn std::error::Error>> {
    match &args.command {
        NamespacesSubcommand::List {
            json,
            hello_namespace,
        } => {
            let listed = connect(args, hello_namespace)?.namespaces()?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&listed)?);
            } else {
                print_table(&listed);
            }
            Ok(())
        }
        NamespacesSubcommand::Retire { name, yes } => {
            let mut client = connect(args, name)?;
            if !*yes {
                let listed = client.namespaces()?;
                let found = listed["namespaces"]
                    .as_array()
                    .and_then(|all| all.iter().find(|n| n["name"] == name.as_str()));
                match found {
                    Some(n) => println!(
                        "would retire namespace {name:?}: {} blocks, {} bytes on node {} \
                         (and what other cluster members hold of it); run again with --yes",
                        n["blocks"], n["bytes"], listed["node"]
                    ),
                    None => println!(
                        "namespace {name:?} holds no block on node {}; run again with --yes \
                         to retire it anyway (other cluster members may hold some)",
                        listed["node"]
                    ),
                }
                return Ok(());
            }
            let retired = client.retire_namespace()?;
            println!(
                "retired namespace {name:?}: {} blocks, {} bytes removed ({} tombstones written, durable)",
                retired.blocks, retired.bytes, retired.tombstones
            );
            Ok(())
        }
    }
}

fn print_table(listed: &Value) {
    let empty = Vec::new();
    let all = listed["namespaces"].as_array().unwrap_or(&empty);
    println!("node {}: {} namespaces", listed["node"], all.len());
    println!(
        "{:>10} {:>14} {:>12}  {:<48}  described",
        "blocks", "bytes", "last used", "namespace"
    );
    for n in all {
        let last = n["last_used_unix_s"]
            .as_u64()
            .map_or_else(|| "-".to_string(), |t| t.to_string());
        let manifest = match &n["manifest"] {
            Value::Object(fields) => fields
                .iter()
                .filter(|(k, _)| !k.ends_with("_unix_s"))
                .map(|(k, v)| {
                    format!(
                        "{}={}",
                        printable(k),
                        printable(&v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                    )
                })
                .collect::<Vec<_>>()
                .join(" "),
            _ => "-".to_string(),
        };
        println!(
            "{:>10} {:>14} {:>12}  {:<48}  {}",
            n["blocks"],
            n["bytes"],
            last,
            printable(n["name"].as_str().unwrap_or("")),
            manifest
        );
    }
}

/// `text` as the operator's terminal should show it: control characters
/// (ESC, BEL, CR, ...) and the characters that reorder or hide text
/// (bidirectional overrides and isolates, zero-width marks) written as
/// `\u{..}` escapes. A manifest's fields are whatever a tenant stored:
/// raw, they could rewrite the table or the terminal.
fn printable(text: &str) -> String {
    let hides = |c: char| {
        c.is_control()
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    };
    text.chars()
        .map(|c| {
            if hides(c) {
                format!("\\u{{{:x}}}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::printable;

    /// Issue 60: `kvtier namespaces list` printed a tenant's ESC, BEL, CR
    /// and right-to-left override characters raw to the operator's
    /// terminal.
    #[test]
    fn a_tenants_control_and_reordering_characters_are_escaped() {
        let stored = "vllm\x1b[2J\x07\rllama\u{202e}lmth.exe\u{2066}";
        let shown = printable(stored);
        assert_eq!(
            shown,
            "vllm\\u{1b}[2J\\u{7}\\u{d}llama\\u{202e}lmth.exe\\u{2066}"
        );
        assert!(!shown.chars().any(|c| c.is_control()));
        assert_eq!(printable("team-a/llama3 ünïcödé"), "team-a/llama3 ünïcödé");
    }
}
