//! Code mode (DESIGN.md, "Code mode"): code run by the MCP tool `execute` calls functions
//! the broker serves itself over the exec's tool bridge, with no client round trip:
//!
//! - `codemode.http.fetch({url, method?, headers?, body?})`: the broker makes the request,
//!   for hosts on `CODEBROKER_CODEMODE_HTTP_ALLOW` only (redirects included; a name must
//!   resolve to a public address unless that address is listed), so the container keeps
//!   no network;
//! - `codemode.env.get({key})`: variables of the broker's environment on
//!   `CODEBROKER_CODEMODE_ENV_ALLOW`;
//! - `codemode.<server>.<tool>(args)`: tools of the upstream MCP servers of
//!   `CODEBROKER_CODEMODE_MCP_SERVERS`, connected once with rmcp's client.
//!
//! The bridge's tools are flat names (`http.fetch`, `srv.add`); the code this module wraps
//! around the caller's builds the nested `codemode.<ns>.<name>` objects from them (first dot
//! only) in JavaScript/TypeScript and Python, and reports the code's value and error through
//! one more, internal tool ([`RESULT_TOOL`]).

use crate::config::Config;
use crate::core::{Broker, Error, ExecHooks, ExecInput, ToolBridge, Verdict};
use crate::session::Session;
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::service::{RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use sandbox_runner::{Language, Stream, ToolCall, ToolResult, ToolSpec, WorkerMessage};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The internal tool the wrapper reports the code's value and error with.
pub const RESULT_TOOL: &str = "__codemode_result";
/// Most redirects `http.fetch` follows.
const MAX_REDIRECTS: usize = 5;
/// How long an upstream server that could not be connected is left alone before the next
/// use tries again: a server that is down costs one attempt per interval, not one per call.
const RECONNECT_AFTER: Duration = Duration::from_secs(2);
/// How deep JSON Schemas are turned into types.
const MAX_SCHEMA_DEPTH: usize = 6;
/// Most tools `search` returns.
const MAX_SEARCH_HITS: usize = 10;
/// Events of a running `execute` queued for the collector, which drains them at once.
const EVENT_QUEUE: usize = 16;

/// What one `execute` produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The value the code returned (JS/TS `return`, a lone expression, Python's last
    /// expression), as JSON; `null` when none.
    pub result: Value,
    /// Lines the code printed (console.log/warn/error, print), stdout and stderr in order.
    pub logs: Vec<String>,
    /// Why the code failed (an exception, a limit), when it did.
    pub error: Option<String>,
}

impl Outcome {
    /// `{result, logs, error}`.
    pub fn to_json(&self) -> Value {
        json!({ "result": self.result, "logs": self.logs, "error": self.error })
    }
}

/// Variables of the broker's environment every `stdio:` upstream server gets: enough to
/// find programs and run them (`npx`, `uvx` keep caches under `HOME`).
const UPSTREAM_BASE_ENV: [&str; 6] = ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// One allowed HTTP host: a name, and a port unless the web's own ports are meant.
#[derive(Debug, Clone, PartialEq)]
struct HostRule {
    /// Lowercase host name or IP address (IPv6 without brackets).
    host: String,
    /// The one port allowed; `None` allows 80 and 443 (a bare name is a web site, not
    /// every service its host runs).
    port: Option<u16>,
}

impl HostRule {
    /// `name`, `name:port`, `[v6]`, `[v6]:port` or a bare IPv6 address.
    fn parse(entry: &str) -> Option<HostRule> {
        let entry = entry.trim().to_ascii_lowercase();
        if entry.is_empty() {
            return None;
        }
        if let Some(rest) = entry.strip_prefix('[') {
            let (host, after) = rest.split_once(']')?;
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p.parse().ok()?),
                None if after.is_empty() => None,
                None => return None,
            };
            return Some(HostRule {
                host: host.to_string(),
                port,
            });
        }
        match entry.matches(':').count() {
            0 => Some(HostRule {
                host: entry,
                port: None,
            }),
            1 => {
                let (host, port) = entry.split_once(':')?;
                Some(HostRule {
                    host: host.to_string(),
                    port: Some(port.parse().ok()?),
                })
            }
            _ => Some(HostRule {
                host: entry,
                port: None,
            }),
        }
    }
}

/// The host of `url` as the denial names it, and whether `rules` allow it.
fn host_allowed(rules: &[HostRule], url: &reqwest::Url) -> (String, bool) {
    let host = url
        .host_str()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let port = url.port_or_known_default();
    let port_ok = |rule: &HostRule| match rule.port {
        Some(allowed) => port == Some(allowed),
        None => matches!(port, Some(80 | 443)),
    };
    let ok = matches!(url.scheme(), "http" | "https")
        && rules.iter().any(|r| r.host == host && port_ok(r));
    let shown = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host,
    };
    (shown, ok)
}

/// Whether `ip` is an address of the public internet: not loopback, private, link-local,
/// unique-local, shared (CGNAT), unspecified, multicast, broadcast, documentation or
/// reserved. IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4) are judged by it.
fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let seg = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)
            };
            if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return is_public_v4(embedded(seg[6], seg[7]));
            }
            if seg[0] == 0x2002 {
                return is_public_v4(embedded(seg[1], seg[2]));
            }
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || seg[..6] == [0; 6] // IPv4-compatible (deprecated)
                || (seg[0] & 0xfe00) == 0xfc00 // unique local
                || (seg[0] & 0xffc0) == 0xfe80 // link-local
                || (seg[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (seg[0] == 0x2001 && seg[1] == 0x0db8) // documentation
                || seg[..4] == [0x0100, 0, 0, 0]) // discard
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // "this network", unspecified
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local() // the cloud metadata service is here
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || (a == 100 && (b & 0xc0) == 64) // shared address space (CGNAT)
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b & 0xfe) == 18) // benchmarking
        || a >= 240) // reserved
}

/// `http.fetch`'s name resolution: the addresses a name resolves to, less those that are not
/// public (unless listed literally, or allowed by the operator). reqwest connects to the
/// addresses given here, so the address checked is the address used: a name that
/// re-binds between a check and the connection cannot exist.
struct CheckedResolver {
    /// Addresses the allowlist names literally: reachable even when not public.
    listed: Vec<IpAddr>,
    /// `CODEBROKER_CODEMODE_HTTP_ALLOW_PRIVATE`: every address is reachable.
    allow_private: bool,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_string();
        let listed = self.listed.clone();
        let allow_private = self.allow_private;
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let (usable, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
                .into_iter()
                .partition(|a| allow_private || is_public(a.ip()) || listed.contains(&a.ip()));
            if usable.is_empty() {
                if let Some(first) = refused.first() {
                    let denied = Denied(format!(
                        "Host '{name}' resolves to a non-public address ({}), which is not \
                         allowed unless the address itself is listed",
                        first.ip()
                    ));
                    return Err(Box::new(denied) as Box<dyn std::error::Error + Send + Sync>);
                }
            }
            Ok(Box::new(usable.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A request refused by the allowlist or the address policy (found again in reqwest's
/// error chain).
#[derive(Debug)]
struct Denied(String);

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Denied {}

/// Where an upstream MCP server is.
#[derive(Debug, Clone, PartialEq)]
enum Target {
    /// Streamable HTTP at this URL.
    Http(String),
    /// A child process speaking MCP on stdio: program and arguments.
    Stdio(Vec<String>),
}

/// `name=http://...` or `name=stdio:command args`.
fn parse_server(entry: &str) -> Result<(String, Target), String> {
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

/// One connected upstream MCP server.
struct Upstream {
    /// Its name in `codemode.<name>`.
    name: String,
    /// The rmcp client.
    client: RunningService<RoleClient, ClientConfig>,
    /// Its tools as listed when it was connected.
    tools: Vec<rmcp::model::Tool>,
}

/// An upstream server's place: connected on first use, reconnected when the connection is
/// lost (the server restarted, its process died) or could not be made.
struct UpstreamSlot {
    /// Its name in `codemode.<name>`.
    name: String,
    /// Where it is.
    target: Target,
    /// The connection, if any. An async mutex so that callers arriving while it connects
    /// wait for that one attempt instead of each starting their own.
    state: tokio::sync::Mutex<SlotState>,
}

/// What is known of an upstream server's connection.
#[derive(Default)]
struct SlotState {
    /// The live connection.
    live: Option<Arc<Upstream>>,
    /// When the last attempt failed; the next waits for [`RECONNECT_AFTER`].
    failed_at: Option<Instant>,
}

/// Code mode's settings and connections, shared by every MCP session.
pub struct CodeMode {
    /// Whether `execute` and `search` are offered.
    pub enabled: bool,
    /// Hosts `http.fetch` may reach.
    http_allow: Arc<Vec<HostRule>>,
    /// Variables `env.get` may read.
    env_allow: Vec<String>,
    /// Variables a `stdio:` upstream server gets besides [`UPSTREAM_BASE_ENV`].
    upstream_env: Vec<String>,
    /// Upstream servers as configured (valid entries), with their connections.
    upstreams: Vec<UpstreamSlot>,
    /// The HTTP client of `http.fetch` (its redirect policy checks the allowlist); `None`
    /// when it could not be made (then no HTTP at all, rather than a client without it).
    http: Option<reqwest::Client>,
    /// Largest body `http.fetch` passes.
    max_body: u64,
    /// Time limit of one call.
    call_timeout: Duration,
    /// Time limit of one `execute`.
    exec_timeout_ms: u64,
}

impl CodeMode {
    /// Code mode from the configuration; starts connecting upstream servers in the
    /// background when enabled and inside a runtime.
    pub fn new(config: &Config) -> Arc<CodeMode> {
        let http_allow: Arc<Vec<HostRule>> = Arc::new(
            config
                .codemode_http_allow
                .iter()
                .filter_map(|e| HostRule::parse(e))
                .collect(),
        );
        let env_allow = config
            .codemode_env_allow
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        let mut upstreams = Vec::new();
        for entry in config.codemode_mcp_servers.iter().map(|e| e.trim()) {
            if entry.is_empty() {
                continue;
            }
            match parse_server(entry) {
                Ok((name, target)) => upstreams.push(UpstreamSlot {
                    name,
                    target,
                    state: Default::default(),
                }),
                Err(e) => tracing::warn!(error = %e, "ignoring a code mode MCP server"),
            }
        }
        let call_timeout = Duration::from_millis(config.codemode_call_timeout_ms.max(1));
        let rules = http_allow.clone();
        let policy = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= MAX_REDIRECTS {
                return attempt.error(Denied("Too many redirects".into()));
            }
            let from_https = attempt
                .previous()
                .last()
                .is_some_and(|u| u.scheme() == "https");
            if from_https && attempt.url().scheme() != "https" {
                return attempt.error(Denied(
                    "A redirect from https to http is not allowed".into(),
                ));
            }
            let (host, ok) = host_allowed(&rules, attempt.url());
            if ok {
                attempt.follow()
            } else {
                attempt.error(Denied(format!("Host '{host}' is not allowed")))
            }
        });
        let resolver = CheckedResolver {
            listed: http_allow
                .iter()
                .filter_map(|r| r.host.parse().ok())
                .collect(),
            allow_private: config.codemode_http_allow_private,
        };
        let http = reqwest::Client::builder()
            .dns_resolver(Arc::new(resolver))
            .redirect(policy)
            .timeout(call_timeout)
            .no_proxy()
            .build()
            .map_err(|e| tracing::error!(error = %e, "cannot make the code mode HTTP client"))
            .ok();
        let mode = Arc::new(CodeMode {
            enabled: config.codemode,
            http_allow,
            env_allow,
            upstream_env: config
                .codemode_mcp_env
                .iter()
                .map(|k| k.trim().to_string())
                .filter(|k| !k.is_empty())
                .collect(),
            upstreams,
            http,
            max_body: config.codemode_http_max_bytes,
            call_timeout,
            exec_timeout_ms: config.codemode_timeout_ms,
        });
        if mode.enabled && !mode.upstreams.is_empty() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let eager = mode.clone();
                handle.spawn(async move {
                    eager.connected().await;
                });
            }
        }
        mode
    }

    /// The upstream servers connected now (connecting or reconnecting those that are not,
    /// unless they failed a moment ago; failures are logged).
    async fn connected(&self) -> Vec<Arc<Upstream>> {
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
                    let mut command = tokio::process::Command::new(&words[0]);
                    command.args(&words[1..]);
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

    /// Every function the code may call, sorted by name.
    pub async fn specs(&self) -> Vec<ToolSpec> {
        let mut specs = builtin_specs();
        for upstream in self.connected().await {
            for tool in &upstream.tools {
                specs.push(ToolSpec {
                    name: format!("{}.{}", upstream.name, tool.name),
                    description: tool.description.as_deref().unwrap_or_default().to_string(),
                    parameters: Value::Object((*tool.input_schema).clone()),
                });
            }
        }
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        specs
    }

    /// The output schema of an upstream tool, when it declares one.
    async fn output_schemas(&self) -> BTreeMap<String, Value> {
        let mut out = BTreeMap::new();
        out.insert(
            "http.fetch".to_string(),
            json!({"type": "object", "required": ["status", "headers", "body"], "properties": {
                "status": {"type": "integer"},
                "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                "body": {"type": "string"}}}),
        );
        out.insert("env.get".to_string(), json!({"type": ["string", "null"]}));
        for upstream in self.connected().await {
            for tool in &upstream.tools {
                if let Some(schema) = &tool.output_schema {
                    out.insert(
                        format!("{}.{}", upstream.name, tool.name),
                        Value::Object((**schema).clone()),
                    );
                }
            }
        }
        out
    }

    /// The description of `execute`: what it does, then the functions as TypeScript
    /// declarations and as Python stubs.
    pub async fn execute_description(&self) -> String {
        let specs = self.specs().await;
        let outputs = self.output_schemas().await;
        format!(
            "Run code that calls the functions below and get {{result, logs, error}}: result is \
the value the code returns (JavaScript/TypeScript: `return value;`, or a lone expression; \
Python: the last expression), logs the lines it printed (console.log/warn/error, print), error \
the message when it threw. The code runs in a sandbox with no network; only these functions \
reach outside, and each is awaited (`await codemode.http.fetch({{url}})`, in Python `await \
codemode.http.fetch(url=...)`); run independent calls at once with Promise.all / \
asyncio.gather. A denied call throws an error the code can catch. lang: js (default), ts, \
py. It runs in this MCP session's sandbox session, beside the files of execute_code. Use \
`search` to find functions by topic.\n\n```ts\n{}```\n\n```python\n{}```",
            typescript_declarations(&specs, &outputs),
            python_stubs(&specs)
        )
    }

    /// The functions matching `query`, best first.
    pub async fn search(&self, query: &str) -> Value {
        let specs = self.specs().await;
        let outputs = self.output_schemas().await;
        let hits: Vec<Value> = rank(&specs, query)
            .into_iter()
            .map(|(spec, score)| {
                json!({
                    "name": format!("codemode.{}", spec.name),
                    "description": spec.description,
                    "score": score,
                    "declaration": declaration(spec, outputs.get(&spec.name)),
                })
            })
            .collect();
        json!({ "query": query, "tools": hits })
    }

    /// Answers one call of the code.
    pub async fn serve(&self, call: ToolCall) -> ToolResult {
        let answer = match call.name.as_str() {
            "http.fetch" => self.fetch(&call.input).await,
            "env.get" => self.env_get(&call.input),
            name => self.call_upstream(name, &call.input).await,
        };
        match answer {
            Ok(result) => ToolResult {
                call_id: call.call_id,
                result,
                is_error: false,
                error_message: None,
            },
            Err(message) => ToolResult {
                call_id: call.call_id,
                result: Value::Null,
                is_error: true,
                error_message: Some(message),
            },
        }
    }

    fn env_get(&self, input: &Value) -> Result<Value, String> {
        let key = input
            .get("key")
            .and_then(Value::as_str)
            .ok_or("env.get needs {key: string}")?;
        if !self.env_allow.iter().any(|k| k == key) {
            // Named, not echoed whole: a 4 MB key must not come back as a 4 MB answer.
            let shown: String = key.chars().take(64).collect();
            let more = if shown.len() < key.len() { "..." } else { "" };
            return Err(format!("Key '{shown}{more}' is not allowed"));
        }
        Ok(std::env::var(key).map(Value::String).unwrap_or(Value::Null))
    }

    async fn fetch(&self, input: &Value) -> Result<Value, String> {
        let url = input
            .get("url")
            .and_then(Value::as_str)
            .ok_or("http.fetch needs {url: string}")?;
        let url = reqwest::Url::parse(url).map_err(|e| format!("Invalid URL: {e}"))?;
        let (host, ok) = host_allowed(&self.http_allow, &url);
        if !ok {
            return Err(format!("Host '{host}' is not allowed"));
        }
        let method = input
            .get("method")
            .and_then(Value::as_str)
            .unwrap_or("GET")
            .to_ascii_uppercase();
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|_| format!("Invalid method: {method}"))?;
        let client = self.http.as_ref().ok_or("HTTP is not available")?;
        let mut request = client.request(method, url);
        if let Some(headers) = input.get("headers").and_then(Value::as_object) {
            for (name, value) in headers {
                // The Host header is the allowlist's business.
                if name.eq_ignore_ascii_case("host") {
                    continue;
                }
                let value = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                request = request.header(name.as_str(), value);
            }
        }
        match input.get("body") {
            None | Some(Value::Null) => {}
            Some(body) => {
                let body = match body {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                if body.len() as u64 > self.max_body {
                    return Err(format!(
                        "Request body is larger than {} bytes",
                        self.max_body
                    ));
                }
                request = request.body(body);
            }
        }
        let mut response = request.send().await.map_err(fetch_error)?;
        let status = response.status().as_u16();
        let mut headers = Map::new();
        for (name, value) in response.headers() {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            match headers.get_mut(name.as_str()) {
                Some(Value::String(seen)) => {
                    seen.push_str(", ");
                    seen.push_str(&value);
                }
                _ => {
                    headers.insert(name.as_str().to_string(), Value::String(value));
                }
            }
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(fetch_error)? {
            if (body.len() + chunk.len()) as u64 > self.max_body {
                return Err(format!(
                    "Response body is larger than {} bytes",
                    self.max_body
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(json!({
            "status": status,
            "headers": headers,
            "body": String::from_utf8_lossy(&body),
        }))
    }

    async fn call_upstream(&self, name: &str, input: &Value) -> Result<Value, String> {
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
        let text: Vec<String> = result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect();
        if result.is_error == Some(true) {
            let message = text.join("\n");
            return Err(if message.is_empty() {
                format!("Tool '{name}' failed")
            } else {
                message
            });
        }
        Ok(match result.structured_content {
            Some(value) => value,
            None => Value::String(text.join("\n")),
        })
    }

    /// Runs `code` in `session` with the code mode functions; waits for the end.
    pub async fn run(
        self: &Arc<Self>,
        broker: Arc<Broker>,
        session: Arc<Session>,
        lang: Language,
        code: &str,
        cancel: CancellationToken,
    ) -> Result<Outcome, Error> {
        let code = match lang {
            Language::Js => wrap_js(code),
            Language::Ts => wrap_ts(code),
            Language::Py => wrap_py(code),
            _ => return Err(Error::BadRequest("code mode runs js, ts or py".to_string())),
        };
        let mut specs = self.specs().await;
        specs.push(ToolSpec {
            name: RESULT_TOOL.to_string(),
            description: "Internal: reports the code's value.".to_string(),
            parameters: json!({"type": "object", "properties": {"value": {}, "error": {}}}),
        });
        let (calls_tx, mut calls_rx) = mpsc::unbounded_channel::<ToolCall>();
        let (results_tx, results_rx) = mpsc::unbounded_channel::<ToolResult>();
        let (events_tx, mut events_rx) = mpsc::channel::<WorkerMessage>(EVENT_QUEUE);
        // Output is kept as it comes (the runner caps it); displays have no place in the
        // answer and are dropped here, never queued until the end.
        let collector = tokio::spawn(async move {
            let mut chunks = Vec::new();
            while let Some(event) = events_rx.recv().await {
                if let WorkerMessage::Output(chunk) = event {
                    chunks.push(chunk);
                }
            }
            chunks
        });
        let reported: Arc<Mutex<Option<Value>>> = Arc::default();
        let report = reported.clone();
        let mode = self.clone();
        // Answers the calls as they come, each in a task of its own (Promise.all).
        let server = tokio::spawn(async move {
            while let Some(call) = calls_rx.recv().await {
                if call.name == RESULT_TOOL {
                    if let Ok(mut slot) = report.lock() {
                        *slot = Some(call.input.clone());
                    }
                    let _ = results_tx.send(ToolResult {
                        call_id: call.call_id,
                        result: Value::Null,
                        is_error: false,
                        error_message: None,
                    });
                    continue;
                }
                let mode = mode.clone();
                let results = results_tx.clone();
                tokio::spawn(async move {
                    let _ = results.send(mode.serve(call).await);
                });
            }
        });
        let input = ExecInput {
            lang,
            code,
            args: Vec::new(),
            timeout_ms: Some(self.exec_timeout_ms),
            files: Vec::new(),
        };
        let hooks = ExecHooks {
            events: Some(events_tx),
            tools: Some(ToolBridge {
                specs,
                calls: calls_tx,
                results: results_rx,
            }),
            cancel: Some(cancel),
        };
        // A task of its own: the session's turn is released even if the caller goes away.
        let output = broker.spawn_exec(session, input, hooks).await?;
        server.abort();
        // The exec is over and its sender gone: the collector ends at once.
        let chunks = collector
            .await
            .map_err(|e| Error::internal(format!("output collector failed: {e}")))?;
        let logs = log_lines(&chunks);
        let report = reported.lock().ok().and_then(|r| r.clone());
        let mut result = Value::Null;
        let mut error = None;
        if let Some(report) = report {
            result = report.get("value").cloned().unwrap_or(Value::Null);
            error = report
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if error.is_none() {
            error = match output.verdict() {
                Verdict::Ok => None,
                Verdict::Limit(limits) => {
                    let messages: Vec<&str> = limits.iter().map(|l| l.message()).collect();
                    Some(messages.join("; "))
                }
                Verdict::Failed(code) => Some(format!("The code failed (exit code {code})")),
                Verdict::Stopped => Some("The code was stopped".to_string()),
            };
        }
        Ok(Outcome {
            result,
            logs,
            error,
        })
    }
}

/// The lines the code printed, in the order they were completed; stdout and stderr each
/// keep their own partial line.
fn log_lines(chunks: &[sandbox_runner::OutputChunk]) -> Vec<String> {
    let mut lines = Vec::new();
    let (mut out, mut err) = (String::new(), String::new());
    for chunk in chunks {
        let partial = match chunk.stream {
            Stream::Stdout => &mut out,
            Stream::Stderr => &mut err,
        };
        partial.push_str(&chunk.data);
        while let Some(i) = partial.find('\n') {
            let line: String = partial.drain(..=i).collect();
            lines.push(line.trim_end_matches(['\n', '\r']).to_string());
        }
    }
    for rest in [out, err] {
        if !rest.is_empty() {
            lines.push(rest);
        }
    }
    lines
}

/// A failed request as the code sees it: a refused redirect by its own words.
fn fetch_error(err: reqwest::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(denied) = e.downcast_ref::<Denied>() {
            return denied.0.clone();
        }
        source = e.source();
    }
    if err.is_timeout() {
        return "The request timed out".to_string();
    }
    if err.is_connect() {
        return "Cannot connect".to_string();
    }
    format!("The request failed: {}", err.without_url())
}

/// The functions the broker serves itself.
fn builtin_specs() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "http.fetch".to_string(),
            description: "Make an HTTP request (the broker makes it, for allowed hosts only) and \
get {status, headers, body} with the body as text."
                .to_string(),
            parameters: json!({
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {"type": "string", "description": "http(s) URL"},
                    "method": {"type": "string", "description": "GET (default), POST, ..."},
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    "body": {"type": "string", "description": "request body"}
                },
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: "env.get".to_string(),
            description: "Read an allowed configuration value (null when unset).".to_string(),
            parameters: json!({
                "type": "object",
                "required": ["key"],
                "properties": {"key": {"type": "string"}},
                "additionalProperties": false
            }),
        },
    ]
}

/// Whether `s` may be written as a bare JavaScript property name.
fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
}

/// A property name for TypeScript: bare when it can be, else quoted.
fn ts_key(s: &str) -> String {
    if is_identifier(s) {
        s.to_string()
    } else {
        Value::String(s.to_string()).to_string()
    }
}

/// A TypeScript type for a JSON Schema.
pub fn ts_type(schema: &Value, depth: usize) -> String {
    if depth > MAX_SCHEMA_DEPTH {
        return "unknown".into();
    }
    let Some(obj) = schema.as_object() else {
        return "unknown".into();
    };
    if let Some(value) = obj.get("const") {
        return value.to_string();
    }
    if let Some(values) = obj.get("enum").and_then(Value::as_array) {
        if !values.is_empty() {
            return values
                .iter()
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join(" | ");
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = obj.get(key).and_then(Value::as_array) {
            if !options.is_empty() {
                return options
                    .iter()
                    .map(|o| ts_type(o, depth + 1))
                    .collect::<Vec<_>>()
                    .join(" | ");
            }
        }
    }
    match obj.get("type") {
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| {
                let mut one = obj.clone();
                one.insert("type".into(), t.clone());
                ts_type(&Value::Object(one), depth + 1)
            })
            .collect::<Vec<_>>()
            .join(" | "),
        Some(Value::String(t)) => match t.as_str() {
            "string" => "string".into(),
            "number" | "integer" => "number".into(),
            "boolean" => "boolean".into(),
            "null" => "null".into(),
            "array" => match obj.get("items") {
                Some(items) => format!("Array<{}>", ts_type(items, depth + 1)),
                None => "unknown[]".into(),
            },
            "object" => ts_object(obj, depth),
            _ => "unknown".into(),
        },
        _ if obj.contains_key("properties") => ts_object(obj, depth),
        _ => "unknown".into(),
    }
}

fn ts_object(obj: &Map<String, Value>, depth: usize) -> String {
    let required: Vec<&str> = obj
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut fields = Vec::new();
    if let Some(props) = obj.get("properties").and_then(Value::as_object) {
        let mut names: Vec<&String> = props.keys().collect();
        names.sort();
        for name in names {
            let optional = if required.contains(&name.as_str()) {
                ""
            } else {
                "?"
            };
            fields.push(format!(
                "{}{optional}: {}",
                ts_key(name),
                ts_type(&props[name], depth + 1)
            ));
        }
    }
    match obj.get("additionalProperties") {
        Some(Value::Bool(false)) => {}
        Some(extra @ Value::Object(_)) => {
            fields.push(format!("[key: string]: {}", ts_type(extra, depth + 1)))
        }
        _ if fields.is_empty() => fields.push("[key: string]: unknown".into()),
        _ => {}
    }
    format!("{{ {} }}", fields.join("; "))
}

/// `name(input: {...}): Promise<...>;` for one function, its description as a comment.
fn declaration(spec: &ToolSpec, output: Option<&Value>) -> String {
    let (_, member) = spec.name.split_once('.').unwrap_or(("", &spec.name));
    let returns = output.map_or_else(|| "unknown".to_string(), |o| ts_type(o, 0));
    let mut out = String::new();
    let description = spec.description.trim();
    if !description.is_empty() {
        let _ = writeln!(out, "/** {} */", description.replace("*/", "* /"));
    }
    let _ = write!(
        out,
        "{}(input: {}): Promise<{returns}>;",
        ts_key(member),
        ts_type(&spec.parameters, 0)
    );
    out
}

/// `declare const codemode: {...}` for `specs` (sorted by name), one namespace per first
/// segment of the names.
pub fn typescript_declarations(specs: &[ToolSpec], outputs: &BTreeMap<String, Value>) -> String {
    let mut spaces: BTreeMap<&str, Vec<&ToolSpec>> = BTreeMap::new();
    for spec in specs {
        let ns = spec.name.split_once('.').map_or("", |(ns, _)| ns);
        spaces.entry(ns).or_default().push(spec);
    }
    let mut out = String::from("declare const codemode: {\n");
    for (ns, specs) in spaces {
        let indent = if ns.is_empty() { "  " } else { "    " };
        if !ns.is_empty() {
            let _ = writeln!(out, "  {}: {{", ts_key(ns));
        }
        for spec in specs {
            for line in declaration(spec, outputs.get(&spec.name)).lines() {
                let _ = writeln!(out, "{indent}{line}");
            }
        }
        if !ns.is_empty() {
            out.push_str("  };\n");
        }
    }
    out.push_str("};\n");
    out
}

/// A Python annotation for a JSON Schema (simple types only).
fn py_type(schema: &Value) -> &'static str {
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => "str",
        Some("integer") => "int",
        Some("number") => "float",
        Some("boolean") => "bool",
        Some("array") => "list",
        Some("object") => "dict",
        _ => "Any",
    }
}

/// Python stubs: `codemode.<ns>.<name>` as `async def` with keyword-only parameters.
pub fn python_stubs(specs: &[ToolSpec]) -> String {
    let mut out = String::new();
    for spec in specs {
        let required: Vec<&str> = spec
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut params = Vec::new();
        if let Some(props) = spec.parameters.get("properties").and_then(Value::as_object) {
            let mut names: Vec<&String> = props.keys().collect();
            names.sort_by_key(|n| (!required.contains(&n.as_str()), n.to_string()));
            for name in names {
                let ty = py_type(&props[name]);
                if required.contains(&name.as_str()) {
                    params.push(format!("{name}: {ty}"));
                } else {
                    params.push(format!("{name}: {ty} | None = None"));
                }
            }
        }
        let signature = if params.is_empty() {
            "**kwargs".to_string()
        } else {
            format!("*, {}", params.join(", "))
        };
        let _ = writeln!(
            out,
            "async def codemode.{}({signature}) -> Any: ...",
            spec.name
        );
        let description = spec.description.trim();
        if !description.is_empty() {
            let first = description.lines().next().unwrap_or_default();
            let _ = writeln!(out, "    # {first}");
        }
    }
    out
}

/// `specs` that match `query`, with their scores, best first (name matches count more than
/// description matches); every function when the query is blank.
fn rank<'a>(specs: &'a [ToolSpec], query: &str) -> Vec<(&'a ToolSpec, u32)> {
    let terms: Vec<String> = query
        .split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_lowercase)
        .collect();
    let mut hits: Vec<(&ToolSpec, u32)> = specs
        .iter()
        .filter(|s| s.name != RESULT_TOOL)
        .map(|spec| {
            let name = spec.name.to_lowercase();
            let segments: Vec<&str> = name
                .split(|c: char| !c.is_alphanumeric())
                .filter(|s| !s.is_empty())
                .collect();
            let description = spec.description.to_lowercase();
            let score = terms
                .iter()
                .map(|t| {
                    let mut s = 0;
                    if segments.contains(&t.as_str()) {
                        s += 5;
                    } else if name.contains(t.as_str()) {
                        s += 3;
                    }
                    if description.contains(t.as_str()) {
                        s += 1;
                    }
                    s
                })
                .sum();
            (spec, score)
        })
        .filter(|(_, score)| terms.is_empty() || *score > 0)
        .collect();
    hits.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.name.cmp(&b.0.name)));
    hits.truncate(MAX_SEARCH_HITS);
    hits
}

/// Builds `codemode.<ns>.<rest>` from the flat `codemode["ns.rest"]` the runner's prelude
/// defines, and takes the result reporter out of sight. JavaScript, valid TypeScript too.
const JS_SETUP: &str = r#"const __codemode_report: any = (() => {
  const cm: any = (globalThis as any).codemode;
  const report = cm[REPORT];
  delete cm[REPORT];
  for (const key of Object.keys(globalThis)) {
    if ((globalThis as any)[key] === report) delete (globalThis as any)[key];
  }
  for (const key of Object.keys(cm)) {
    const dot = key.indexOf(".");
    if (dot < 1) continue;
    const ns = key.slice(0, dot);
    if (cm[ns] === undefined) cm[ns] = {};
    if (typeof cm[ns] === "object" && cm[ns][key.slice(dot + 1)] === undefined) {
      cm[ns][key.slice(dot + 1)] = cm[key];
    }
  }
  return report;
})();
const __codemode_safe = (v: any) => {
  if (v === undefined) return null;
  try {
    const text = JSON.stringify(v);
    return text === undefined ? String(v) : JSON.parse(text);
  } catch (e) {
    return String(v);
  }
};
const __codemode_message = (e: any) =>
  e instanceof Error ? `${e.name}: ${e.message}` : String(e);
"#;

/// The JavaScript/TypeScript typing in [`JS_SETUP`] removed, for plain JavaScript.
fn js_setup() -> String {
    JS_SETUP
        .replace(": any", "")
        .replace(" as any", "")
        .replace("REPORT", &Value::String(RESULT_TOOL.into()).to_string())
}

/// JavaScript: the code is a lone expression (`return`ed, a function is called) or a
/// function body; either way it sees `require` and friends. The runner runs this inside an
/// async function.
pub fn wrap_js(code: &str) -> String {
    let source = Value::String(code.to_string()).to_string();
    format!(
        r#"{setup}
const __codemode_AsyncFunction = (async () => {{}}).constructor;
const __codemode_params = ["require", "module", "exports", "__filename", "__dirname"];
let __codemode_value = null, __codemode_error = null;
try {{
  let fn;
  try {{
    fn = new __codemode_AsyncFunction(...__codemode_params, "return (\n" + {source} + "\n);");
  }} catch (e) {{
    if (!(e instanceof SyntaxError)) throw e;
    fn = new __codemode_AsyncFunction(...__codemode_params, {source});
  }}
  let value = await fn(require, module, exports, __filename, __dirname);
  if (typeof value === "function") value = await value();
  __codemode_value = __codemode_safe(value);
}} catch (e) {{
  __codemode_error = __codemode_message(e);
}}
await __codemode_report({{ value: __codemode_value, error: __codemode_error }});
"#,
        setup = js_setup()
    )
}

/// TypeScript (compiled to an ES module, which has top-level `await`): the code is a
/// function body; `return` gives the result.
pub fn wrap_ts(code: &str) -> String {
    format!(
        r#"{setup}
let __codemode_value: any = null, __codemode_error: any = null;
try {{
  let value: any = await (async () => {{
{code}
  }})();
  if (typeof value === "function") value = await value();
  __codemode_value = __codemode_safe(value);
}} catch (e) {{
  __codemode_error = __codemode_message(e);
}}
await __codemode_report({{ value: __codemode_value, error: __codemode_error }});
"#,
        setup = JS_SETUP.replace("REPORT", &Value::String(RESULT_TOOL.into()).to_string())
    )
}

/// Python: the code runs like a cell (top-level `await` allowed) in the kernel's globals,
/// its last expression is the result; `codemode.<ns>.<name>` is built from the kernel's tool
/// functions.
pub fn wrap_py(code: &str) -> String {
    let source = Value::String(code.to_string()).to_string();
    format!(
        r#"async def __codemode_main():
    import ast as _ast, inspect as _inspect, json as _json, types as _types
    _g = globals()
    _report = None
    _root = _types.SimpleNamespace()
    for _key, _f in list(_g.items()):
        _name = getattr(_f, "tool_name", None)
        if not isinstance(_name, str) or not callable(_f):
            continue
        if _name == {report}:
            _report = _f
            del _g[_key]
            continue
        _ns, _dot, _rest = _name.partition(".")
        if not _dot:
            setattr(_root, _name, _f)
            continue
        _space = getattr(_root, _ns, None)
        if _space is None:
            _space = _types.SimpleNamespace()
            setattr(_root, _ns, _space)
        setattr(_space, _rest, _f)
    _g["codemode"] = _root
    _value, _error = None, None
    try:
        _tree = _ast.parse({source}, "<code>")
        if _tree.body and isinstance(_tree.body[-1], _ast.Expr):
            _tree.body[-1] = _ast.Assign(
                targets=[_ast.Name(id="__codemode_value", ctx=_ast.Store())],
                value=_tree.body[-1].value,
            )
            _ast.fix_missing_locations(_tree)
        _code = compile(_tree, "<code>", "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        _r = eval(_code, _g)
        if _inspect.iscoroutine(_r):
            await _r
        _value = _g.pop("__codemode_value", None)
        if _inspect.isawaitable(_value):
            _value = await _value
        try:
            _json.dumps(_value)
        except (TypeError, ValueError):
            _value = repr(_value)
    except Exception as _e:
        _error = "%s: %s" % (type(_e).__name__, _e)
    if _report is not None:
        await _report(value=_value, error=_error)

await __codemode_main()
del __codemode_main
"#,
        report = Value::String(RESULT_TOOL.into())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rules() {
        let rules: Vec<HostRule> = ["Example.com", "127.0.0.1:8080", "[::1]:9", "::2"]
            .iter()
            .filter_map(|e| HostRule::parse(e))
            .collect();
        let check = |u: &str| host_allowed(&rules, &reqwest::Url::parse(u).expect("url"));
        assert_eq!(check("https://example.com/x"), ("example.com".into(), true));
        assert!(check("https://EXAMPLE.com:443/").1);
        assert!(
            !check("http://EXAMPLE.com:81/").1,
            "a bare name: 80 and 443 only"
        );
        assert!(check("http://127.0.0.1:8080/").1);
        assert_eq!(
            check("http://127.0.0.1:8081/"),
            ("127.0.0.1:8081".into(), false)
        );
        assert!(check("http://[::1]:9/").1);
        assert!(check("http://[::2]/").1);
        assert!(!check("http://[::2]:1/").1);
        assert!(!check("ftp://example.com/").1);
        assert!(!check("http://evil.com/").1);
        assert!(HostRule::parse("").is_none());
    }

    #[test]
    fn public_addresses() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.17.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "::127.0.0.1",
        ] {
            assert!(!is_public(private.parse().expect("ip")), "{private}");
        }
        for public in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert!(is_public(public.parse().expect("ip")), "{public}");
        }
    }

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

    #[test]
    fn declarations_are_sorted_and_typed() {
        let mut specs = builtin_specs();
        specs.push(ToolSpec {
            name: "srv.add".into(),
            description: "Adds two numbers.".into(),
            parameters: json!({"type": "object", "required": ["a", "b"],
                "properties": {"b": {"type": "integer"}, "a": {"type": "number"}}}),
        });
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let text = typescript_declarations(&specs, &BTreeMap::new());
        assert!(
            text.starts_with("declare const codemode: {\n  env: {\n"),
            "{text}"
        );
        assert!(
            text.contains("add(input: { a: number; b: number }): Promise<unknown>;"),
            "{text}"
        );
        assert!(text.contains(
            "fetch(input: { body?: string; headers?: { [key: string]: string }; method?: string; url: string })"
        ), "{text}");
        assert_eq!(text, typescript_declarations(&specs, &BTreeMap::new()));
        let py = python_stubs(&specs);
        assert!(
            py.contains("async def codemode.srv.add(*, a: float, b: int) -> Any: ..."),
            "{py}"
        );
        assert_eq!(
            ts_type(&json!({"type": ["string", "null"]}), 0),
            "string | null"
        );
        assert_eq!(ts_type(&json!({"enum": ["a", 1]}), 0), "\"a\" | 1");
    }

    #[test]
    fn search_ranks_names_first() {
        let mut specs = builtin_specs();
        specs.push(ToolSpec {
            name: "web.search".into(),
            description: "Search the web over HTTP.".into(),
            parameters: json!({}),
        });
        let hits = rank(&specs, "http");
        let names: Vec<&str> = hits.iter().map(|(s, _)| s.name.as_str()).collect();
        assert_eq!(names, ["http.fetch", "web.search"]);
        assert_eq!(rank(&specs, "").len(), 3);
        assert!(rank(&specs, "zzzq").is_empty());
    }

    #[tokio::test]
    async fn calls_are_answered_or_refused() {
        let mut config = <Config as clap::Parser>::parse_from(["codebroker"]);
        config.codemode_env_allow = vec!["CODEMODE_UNIT_UNSET".into()];
        let mode = CodeMode::new(&config);
        let call = |name: &str, input: Value| ToolCall {
            call_id: "c1".into(),
            name: name.into(),
            input,
            batch: None,
        };
        let r = mode.serve(call("z", json!({}))).await;
        assert_eq!(r.error_message.as_deref(), Some("Unknown tool: 'z'"));
        let r = mode.serve(call("srv.z", json!({}))).await;
        assert_eq!(r.error_message.as_deref(), Some("Unknown tool: 'srv.z'"));
        let r = mode
            .serve(call("http.fetch", json!({"url": "http://127.0.0.1:1/"})))
            .await;
        assert_eq!(
            r.error_message.as_deref(),
            Some("Host '127.0.0.1:1' is not allowed")
        );
        let r = mode.serve(call("env.get", json!({"key": "PATH"}))).await;
        assert_eq!(
            r.error_message.as_deref(),
            Some("Key 'PATH' is not allowed")
        );
        let r = mode
            .serve(call("env.get", json!({"key": "CODEMODE_UNIT_UNSET"})))
            .await;
        assert!(!r.is_error && r.result.is_null(), "{r:?}");
    }

    #[test]
    fn js_setup_has_no_types() {
        let js = js_setup();
        assert!(!js.contains(": any") && !js.contains("as any"), "{js}");
        assert!(js.contains("cm[\"__codemode_result\"]"), "{js}");
    }
}
