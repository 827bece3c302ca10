//! The KV-event feed's keys checked before anything starts: endpoints,
//! logins, and who may reach it (docs/server.md, threat model).

use crate::NodeConfig;
use std::net::SocketAddr;

/// The feed as configured: where it publishes and answers replays, and
/// whether subscribers log in.
#[derive(Debug, Clone)]
pub(crate) struct FeedPlan {
    pub publish: SocketAddr,
    pub replay: Option<SocketAddr>,
    /// How subscribers log in (`kv_events_auth`).
    pub login: FeedLogin,
    pub topic: Option<String>,
}

/// The feed `config` asks for, or none; an error for keys that need
/// others or would expose it.
pub(crate) fn plan(config: &NodeConfig) -> Result<Option<FeedPlan>, String> {
    let Some(at) = config.kv_events.as_deref() else {
        if config.kv_events_replay.is_some() {
            return Err("kv_events_replay needs kv_events".into());
        }
        if config.kv_events_auth.is_some() {
            return Err("kv_events_auth needs kv_events".into());
        }
        return Ok(None);
    };
    let publish = zmq_address(at, "kv_events")?;
    let replay = config
        .kv_events_replay
        .as_deref()
        .map(|r| zmq_address(r, "kv_events_replay"))
        .transpose()?;
    let login = event_feed_login(config.kv_events_auth.as_deref())?;
    check_exposure(
        publish,
        replay,
        config.tenants_file.is_some(),
        login,
        config.kv_events_unauthenticated.unwrap_or(false),
    )?;
    Ok(Some(FeedPlan {
        publish,
        replay,
        login,
        topic: config.kv_events_topic.clone(),
    }))
}

/// How the event feed's peers log in (`kv_events_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FeedLogin {
    /// ZeroMQ's NULL mechanism: no login (`none`, the default).
    None,
    /// ZeroMQ PLAIN with a kvtier token as the password (`plain`).
    Plain,
    /// ZeroMQ CURVE with keys derived from kvtier tokens (`curve`).
    Curve,
}

fn event_feed_login(text: Option<&str>) -> Result<FeedLogin, String> {
    match text {
        None | Some("none") => Ok(FeedLogin::None),
        Some("plain") => Ok(FeedLogin::Plain),
        Some("curve") => Ok(FeedLogin::Curve),
        Some(other) => Err(format!(
            "kv_events_auth must be \"none\", \"plain\" or \"curve\", not {other:?}"
        )),
    }
}

/// The event feed's subscribers read namespaces' block hashes (prompt
/// identities) and names. Without authentication it is served only where
/// every reader is already trusted (loopback, no tenants to keep apart);
/// with `kv_events_auth = "plain"` a subscriber logs in with a token and
/// sees what the token opens, but ZMTP PLAIN sends the token in the clear,
/// so it stays on loopback too (reach it through an SSH tunnel or a VPN).
/// With `kv_events_auth = "curve"` every frame is encrypted and every
/// subscriber proves a key derived from a token, so the feed may leave
/// the host. `kv_events_unauthenticated` publishes it anyway, knowingly
/// (docs/server.md, threat model).
fn check_exposure(
    publish: SocketAddr,
    replay: Option<SocketAddr>,
    tenants: bool,
    login: FeedLogin,
    unauthenticated: bool,
) -> Result<(), String> {
    if unauthenticated || login == FeedLogin::Curve {
        return Ok(());
    }
    for (what, at) in [("kv_events", Some(publish)), ("kv_events_replay", replay)] {
        if let Some(at) = at.filter(|a| !a.ip().is_loopback()) {
            return Err(format!(
                "{what} {at}: the event feed shows namespaces' block hashes, which identify \
                 prompts, and ZeroMQ's PLAIN login would send a token in the clear; set \
                 kv_events_auth = \"curve\" (encrypted, subscribers prove a key derived from \
                 a token), bind it to loopback (reach it through an SSH tunnel or a VPN), or set \
                 kv_events_unauthenticated = true in the config file to publish it off the host \
                 knowingly"
            ));
        }
    }
    if tenants && login == FeedLogin::None {
        return Err(
            "without authentication every local subscriber of the event feed would \
                    read every tenant's namespaces and block hashes; set kv_events_auth = \
                    \"plain\" or \"curve\" (subscribers log in with a token and see what it \
                    opens), leave \
                    kv_events off with --tenants, or set kv_events_unauthenticated = true in the \
                    config file knowingly"
                .into(),
        );
    }
    Ok(())
}

fn zmq_address(text: &str, what: &str) -> Result<SocketAddr, String> {
    let bare = text.strip_prefix("tcp://").unwrap_or(text);
    if bare.contains("://") {
        return Err(format!("{what} {text:?}: only tcp:// endpoints are served"));
    }
    std::net::ToSocketAddrs::to_socket_addrs(bare)
        .map_err(|e| format!("{what} {text:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{what} {text:?}: resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> NodeConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn the_feed_stays_on_loopback_and_apart_from_tenants_unless_told() {
        assert!(plan(&config("")).unwrap().is_none());
        let feed = plan(&config("kv_events = \"tcp://127.0.0.1:5557\"\n"))
            .unwrap()
            .unwrap();
        assert_eq!(feed.publish, "127.0.0.1:5557".parse().unwrap());
        assert!(feed.login == FeedLogin::None && feed.replay.is_none());
        let off_host = plan(&config("kv_events = \"tcp://0.0.0.0:5557\"\n")).unwrap_err();
        assert!(off_host.contains("in the clear"), "{off_host}");
        let replay_off_host = plan(&config(
            "kv_events = \"tcp://127.0.0.1:5557\"\nkv_events_replay = \"tcp://0.0.0.0:5558\"\n",
        ))
        .unwrap_err();
        assert!(
            replay_off_host.starts_with("kv_events_replay"),
            "{replay_off_host}"
        );
        let tenants = plan(&config(
            "kv_events = \"tcp://127.0.0.1:5557\"\ntenants_file = \"/t.toml\"\n",
        ))
        .unwrap_err();
        assert!(tenants.contains("every tenant's namespaces"), "{tenants}");
        assert!(plan(&config(
            "kv_events = \"tcp://127.0.0.1:5557\"\ntenants_file = \"/t.toml\"\nkv_events_auth = \"plain\"\n",
        ))
        .unwrap()
        .unwrap()
        .login
            == FeedLogin::Plain);
        assert!(plan(&config(
            "kv_events = \"tcp://0.0.0.0:5557\"\nkv_events_unauthenticated = true\n"
        ))
        .is_ok());
        // CURVE encrypts and authenticates: off the host and beside
        // tenants without opting in.
        let curve = plan(&config(
            "kv_events = \"tcp://0.0.0.0:5557\"\nkv_events_replay = \"tcp://0.0.0.0:5558\"\n\
             tenants_file = \"/t.toml\"\nkv_events_auth = \"curve\"\n",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(curve.login, FeedLogin::Curve);
        assert!(
            off_host.contains("kv_events_auth = \"curve\""),
            "{off_host}"
        );
    }

    #[test]
    fn keys_that_need_the_feed_or_name_a_bad_endpoint_are_refused() {
        assert!(plan(&config("kv_events_replay = \"tcp://127.0.0.1:1\"\n"))
            .unwrap_err()
            .contains("needs kv_events"));
        assert!(plan(&config("kv_events_auth = \"plain\"\n"))
            .unwrap_err()
            .contains("needs kv_events"));
        assert!(plan(&config("kv_events = \"ipc:///tmp/x\"\n"))
            .unwrap_err()
            .contains("only tcp://"));
        assert!(plan(&config(
            "kv_events = \"tcp://127.0.0.1:5557\"\nkv_events_auth = \"tls\"\n"
        ))
        .unwrap_err()
        .contains("\"none\", \"plain\" or \"curve\""));
    }
}
