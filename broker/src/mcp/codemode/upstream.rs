//! Upstream MCP servers (`CODEBROKER_CODEMODE_MCP_SERVERS`): their slots, connected on
//! first use and again after a lost connection, and the calls the code makes to them.

use super::{json_size, CodeMode};
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::service::{RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an upstream server that could not be connected is left alone before the next
/// use tries again: a server that is down costs one attempt per interval, not one per call.
const RECONNECT_AFTER: Duration = Duration::from_secs(2);

/// Variables of the broker's environment every `stdio:` upstream server gets: enough to
/// find programs and run them (`npx`, `uvx` keep caches under `HOME`).
const UPSTREAM_BASE_ENV: [&str; 6] = ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// Largest result (as JSON) or error message an upstream tool call passes to the code:
/// the code decides what the tool is asked, so a tool (a file reader) may answer with as
/// much as its transport carries (16 MiB per message in rmcp).
const MAX_RESULT_BYTES: u64 = 4 << 20;

/// Where an upstream MCP server is.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Target {
    /// Streamable HTTP at this URL.
    Http(String),
    /// A child process speaking MCP on stdio: program and arguments.
    Stdio(Vec<String>),
}

/// `name=http://...` or `name=stdio:command args`.
pub(super) fn parse_server(entry: &str) -> Result<(String, Target), String> {
    let (name, target) = entry
        .split_once('=')
        .ok_or_else(|| format!("{entry:?}: expected name=target"))?;
    let name = name.trim();
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid || name == "http" || name == "env" {
        return Err(format!(
            "{name:?}: a server name must be an identifier other than http and env"
        ));
    }
    let target = target.trim();
    if let Some(command) = target.strip_prefix("stdio:") {
        let words: Vec<String> = command.split_whitespace().map(str::to_string).collect();
        if words.is_empty() {
            return Err(format!("{name}: stdio: needs a command"));
        }
        return Ok((name.to_string(), Target::Stdio(words)));
    }
    if target.starts_with("http://") || target.starts_with("https://") {
        return Ok((name.to_string(), Target::Http(target.to_string())));
    }
    Err(format!("{name}: expected an http(s) URL or stdio:command"))
}

/// A home directory of `uid`'s own for `stdio:` upstream servers (`$TMPDIR/codebroker-mcp-<uid>`,
/// mode 0700), made on first use; one that is not a directory of `uid`'s is refused.
fn upstream_home(uid: u32) -> Result<std::path::PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let home = std::env::temp_dir().join(format!("codebroker-mcp-{uid}"));
    let fail = |e: std::io::Error| format!("cannot make {}: {e}", home.display());
    match std::fs::DirBuilder::new().mode(0o700).create(&home) {
        Ok(()) => std::os::unix::fs::chown(&home, Some(uid), Some(uid)).map_err(fail)?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(e)),
    }
    let meta = std::fs::symlink_metadata(&home).map_err(fail)?;
    if !meta.is_dir() || meta.uid() != uid {
        return Err(format!(
            "{} is not a directory of uid {uid}",
            home.display()
        ));
    }
    Ok(home)
}

/// One connected upstream MCP server.
pub(super) struct Upstream {
    /// Its name in `codemode.<name>`.
    pub(super) name: String,
    /// The rmcp client.
    client: RunningService<RoleClient, ClientConfig>,
    /// Its tools as listed when it was connected.
    pub(super) tools: Vec<rmcp::model::Tool>,
}

/// An upstream server's place: connected on first use, reconnected when the connection is
/// lost (the server restarted, its process died) or could not be made.
pub(super) struct UpstreamSlot {
    /// Its name in `codemode.<name>`.
    pub(super) name: String,
    /// Where it is.
    pub(super) target: Target,
    /// The connection, if any. An async mutex so that callers arriving while it connects
    /// wait for that one attempt instead of each starting their own.
    pub(super) state: tokio::sync::Mutex<SlotState>,
}

/// What is known of an upstream server's connection.
#[derive(Default)]
pub(super) struct SlotState {
    /// The live connection.
    live: Option<Arc<Upstream>>,
    /// When the last attempt failed; the next waits for [`RECONNECT_AFTER`].
    failed_at: Option<Instant>,
}

impl CodeMode {
    /// The upstream servers connected now (connecting or reconnecting those that are not,
    /// unless they failed a moment ago; failures are logged).
    pub(super) async fn connected(&self) -> Vec<Arc<Upstream>> {
        let live = self.upstreams.iter().map(|slot| self.live(slot));
        futures::future::join_all(live)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// The slot's live connection: the one it has, or a new one.
    async fn live(&self, slot: &UpstreamSlot) -> Option<Arc<Upstream>> {
        let mut state = slot.state.lock().await;
        if let Some(upstream) = &state.live {
            if !upstream.client.is_transport_closed() {
                return Some(upstream.clone());
            }
            tracing::warn!(server = %slot.name, "code mode MCP server connection lost");
            state.live = None;
        }
        if state
            .failed_at
            .is_some_and(|at| at.elapsed() < RECONNECT_AFTER)
        {
            return None;
        }
        let upstream = self.connect(&slot.name, &slot.target).await;
        state.failed_at = upstream.is_none().then(Instant::now);
        state.live = upstream.clone();
        upstream
    }

    /// Drops `dead` from its slot (unless it was replaced already), so that the next use
    /// connects again.
    async fn forget(&self, slot: &UpstreamSlot, dead: &Arc<Upstream>) {
        let mut state = slot.state.lock().await;
        if state.live.as_ref().is_some_and(|l| Arc::ptr_eq(l, dead)) {
            state.live = None;
        }
    }

    async fn connect(&self, name: &str, target: &Target) -> Option<Arc<Upstream>> {
        let connecting = async {
            let client = match target {
                Target::Http(url) => {
                    let config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                    let transport = StreamableHttpClientTransport::from_config(config);
                    ClientConfig::default()
                        .serve(transport)
                        .await
                        .map_err(|e| e.to_string())?
                }
                Target::Stdio(words) => {
                    let uid = self.upstream_uid;
                    // SAFETY: geteuid has no preconditions.
                    let euid = unsafe { libc::geteuid() };
                    let switch = euid != uid;
                    if switch && !crate::identity::can_switch_uid() {
                        return Err(format!(
                            "the broker (uid {euid}) cannot start it as uid {uid} \
                             (CODEBROKER_CODEMODE_MCP_UID) without root or CAP_SETUID and \
                             CAP_SETGID; set CODEBROKER_CODEMODE_MCP_UID={euid} to run it as \
                             the broker's own uid"
                        ));
                    }
                    let mut command = tokio::process::Command::new(&words[0]);
                    command.args(&words[1..]);
                    // The code drives this process: it owns none of the broker's files
                    // (the data directory), joins none of its groups (the Docker socket's)
                    // and keeps no capability.
                    // SAFETY: the hook makes syscalls only, as a child between fork and
                    // exec may.
                    unsafe {
                        command.pre_exec(move || crate::identity::become_upstream(uid, switch));
                    }
                    // The code drives this process: it gets no keys of the broker's.
                    command.env_clear();
                    let names = UPSTREAM_BASE_ENV
                        .iter()
                        .copied()
                        .chain(self.upstream_env.iter().map(String::as_str));
                    for name in names {
                        if let Some(value) = std::env::var_os(name) {
                            command.env(name, value);
                        }
                    }
                    if switch {
                        // The broker's HOME is not the upstream uid's to write (npx and
                        // uvx keep their caches there).
                        command.env("HOME", upstream_home(uid)?);
                    }
                    let transport = TokioChildProcess::new(command).map_err(|e| e.to_string())?;
                    ClientConfig::default()
                        .serve(transport)
                        .await
                        .map_err(|e| e.to_string())?
                }
            };
            let tools = client.list_all_tools().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(Upstream {
                name: name.to_string(),
                client,
                tools,
            })
        };
        match tokio::time::timeout(self.call_timeout, connecting).await {
            Ok(Ok(upstream)) => {
                tracing::info!(
                    server = name,
                    tools = upstream.tools.len(),
                    "code mode MCP server connected"
                );
                Some(Arc::new(upstream))
            }
            Ok(Err(e)) => {
                tracing::warn!(server = name, error = %e, "cannot connect a code mode MCP server");
                None
            }
            Err(_) => {
                tracing::warn!(server = name, "code mode MCP server did not answer in time");
                None
            }
        }
    }

    pub(super) async fn call_upstream(&self, name: &str, input: &Value) -> Result<Value, String> {
        let unknown = || format!("Unknown tool: '{name}'");
        let (server, tool) = name.split_once('.').ok_or_else(unknown)?;
        let slot = self
            .upstreams
            .iter()
            .find(|u| u.name == server)
            .ok_or_else(unknown)?;
        let mut params = CallToolRequestParams::new(tool.to_string());
        match input {
            Value::Object(args) => params = params.with_arguments(args.clone()),
            Value::Null => {}
            _ => return Err(format!("Tool '{name}' takes an object")),
        }
        let unreachable =
            || format!("Tool '{name}' is unavailable: server '{server}' cannot be reached");
        // A request that could not be sent never reached the server, so it is sent once
        // more on a new connection (the server restarted and forgot our MCP session, say).
        // A connection lost after sending is not retried: the tool may have run.
        let mut resent = false;
        let result = loop {
            let upstream = self.live(slot).await.ok_or_else(unreachable)?;
            if !upstream.tools.iter().any(|t| t.name == tool) {
                return Err(unknown());
            }
            let call = upstream.client.call_tool(params.clone());
            let outcome = tokio::time::timeout(self.call_timeout, call)
                .await
                .map_err(|_| format!("Tool '{name}' did not answer in time"))?;
            match outcome {
                Ok(result) => break result,
                Err(ServiceError::TransportSend(e)) if !resent => {
                    tracing::warn!(server, error = %e, "code mode MCP server unreachable; reconnecting");
                    self.forget(slot, &upstream).await;
                    resent = true;
                }
                Err(e @ (ServiceError::TransportSend(_) | ServiceError::TransportClosed)) => {
                    self.forget(slot, &upstream).await;
                    return Err(format!(
                        "Tool '{name}' failed: the server's connection was lost ({e})"
                    ));
                }
                Err(e) => return Err(format!("Tool '{name}' failed: {e}")),
            }
        };
        let too_large = |size: u64| {
            format!(
                "Tool '{name}' returned {size} bytes, more than the {MAX_RESULT_BYTES} bytes \
                 a result may have"
            )
        };
        let text: Vec<&str> = result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
            .collect();
        let text_size = text.iter().map(|t| t.len() as u64 + 1).sum::<u64>();
        if result.is_error == Some(true) {
            if text_size > MAX_RESULT_BYTES {
                return Err(too_large(text_size));
            }
            let message = text.join("\n");
            return Err(if message.is_empty() {
                format!("Tool '{name}' failed")
            } else {
                message
            });
        }
        let value = match result.structured_content {
            Some(value) => value,
            None if text_size > MAX_RESULT_BYTES => return Err(too_large(text_size)),
            None => Value::String(text.join("\n")),
        };
        let size = json_size(&value);
        if size > MAX_RESULT_BYTES {
            return Err(too_large(size));
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_parse() {
        assert_eq!(
            parse_server("a=http://h:1/mcp"),
            Ok(("a".into(), Target::Http("http://h:1/mcp".into())))
        );
        assert_eq!(
            parse_server("b = stdio:node s.js --x"),
            Ok((
                "b".into(),
                Target::Stdio(vec!["node".into(), "s.js".into(), "--x".into()])
            ))
        );
        assert!(parse_server("http=http://h").is_err());
        assert!(parse_server("a-b=http://h").is_err());
        assert!(parse_server("a=ftp://h").is_err());
        assert!(parse_server("a").is_err());
    }
}
