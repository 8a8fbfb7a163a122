//! The MCP tools (`execute_code`, `upload_file`, `list_files`, `read_file`, and code
//! mode's `execute` and `search`) and the MCP session's memory of its codebroker session.

use crate::core::files::{StagedFile, UploadOptions};
use crate::core::{Broker, Error, ExecHooks, ExecInput, SessionChoice};
use crate::http::auth::Caller;
use crate::http::AppState;
use crate::ids::{is_valid_id, new_id};
use crate::mcp::codemode::CodeMode;
use crate::render::{
    content_type, download_url, inline_image_mime, mcp_exec_result, read_blob,
    MAX_INLINE_IMAGE_BYTES,
};
use crate::session::Session;
use crate::workspace::FileRecord;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, Implementation, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler};
use sandbox_runner::Language;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Largest text file `read_file` returns inline; larger ones are links.
const MAX_INLINE_TEXT_BYTES: u64 = 1024 * 1024;

/// What the server tells clients at `initialize`.
const INSTRUCTIONS: &str = "codebroker runs code in a locked-down sandbox with no network. \
Files live in /mnt/data (the working directory) and persist across calls in the same session; \
Python keeps its variables between calls too. Every result names its session_id: calls \
without session_id continue this connection's session, and passing a session_id continues \
that session.";

/// `execute_code` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct ExecuteCodeArgs {
    /// Language: py, js, ts, c, cpp, java, php, rs, go, d, f90, r or bash (python,
    /// javascript, typescript, sh and the like work too).
    pub(crate) lang: String,
    /// The program. Its working directory is /mnt/data, where uploaded files are and where
    /// files it writes are collected; matplotlib figures shown with plt.show() come back as
    /// images.
    pub(crate) code: String,
    /// The session_id of an earlier result, to run in that session (its files, and Python's
    /// variables). Leave it out to continue this connection's session.
    #[serde(default)]
    pub(crate) session_id: Option<String>,
    /// Command-line arguments for the program.
    #[serde(default)]
    pub(crate) args: Option<Vec<String>>,
}

/// `upload_file` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct UploadFileArgs {
    /// The session to put the file in; leave it out for this connection's session (a new
    /// one when there is none yet).
    #[serde(default)]
    pub(crate) session_id: Option<String>,
    /// File name, relative to /mnt/data (subfolders allowed, e.g. data/in.csv).
    pub(crate) name: String,
    /// The file's bytes, base64-encoded.
    pub(crate) content_base64: String,
}

/// `list_files` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct ListFilesArgs {
    /// The session whose files to list; leave it out for this connection's session.
    #[serde(default)]
    pub(crate) session_id: Option<String>,
}

/// `read_file` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct ReadFileArgs {
    /// The session holding the file; leave it out for this connection's session.
    #[serde(default)]
    pub(crate) session_id: Option<String>,
    /// The file's name as listed, relative to /mnt/data (a /mnt/data/ prefix is accepted).
    pub(crate) name: String,
}

/// `execute` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct ExecuteArgs {
    /// The code: JavaScript (default) or TypeScript, `return` gives the result (a lone
    /// expression is returned as it is); Python: the last expression is the result.
    pub(crate) code: String,
    /// js (default), ts or py.
    #[serde(default)]
    pub(crate) lang: Option<String>,
}

/// `search` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct SearchArgs {
    /// Words to look for in the functions' names and descriptions; empty lists all.
    pub(crate) query: String,
}

/// The MCP server of one MCP session.
#[derive(Clone)]
pub(crate) struct CodeTools {
    /// The broker and the HTTP layer's shared state.
    state: AppState,
    /// The codebroker session this MCP session works in, once it has one; the lock is held
    /// while a session is chosen, so concurrent first calls do not make two.
    session: Arc<tokio::sync::Mutex<Option<String>>>,
    /// The tools, as `#[tool_router]` collects them (without `execute` and `search` when
    /// code mode is off).
    tool_router: ToolRouter<CodeTools>,
    /// Code mode's functions and connections, shared by all MCP sessions.
    codemode: Arc<CodeMode>,
}

#[tool_router]
impl CodeTools {
    pub(super) fn new(state: AppState, codemode: Arc<CodeMode>) -> CodeTools {
        let mut tool_router = Self::tool_router();
        if !codemode.enabled {
            tool_router.remove_route("execute");
            tool_router.remove_route("search");
        }
        CodeTools {
            state,
            session: Arc::default(),
            tool_router,
            codemode,
        }
    }

    #[tool(
        name = "execute",
        description = "Run JavaScript (default), TypeScript or Python that calls the code mode \
functions (codemode.*) and get {result, logs, error}. The full description lists the functions."
    )]
    async fn execute_tool(
        &self,
        Parameters(args): Parameters<ExecuteArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = caller_of(&ctx).await;
        Ok(self
            .codemode_execute(args, &caller, ctx.ct.clone())
            .await
            .unwrap_or_else(tool_error))
    }

    #[tool(
        description = "Find code mode functions (for `execute`) by words in their names and \
descriptions, best matches first, with their TypeScript declarations."
    )]
    async fn search(
        &self,
        Parameters(args): Parameters<SearchArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let found = self.codemode.search(&args.query).await;
        let mut lines: Vec<String> = found["tools"]
            .as_array()
            .map(|tools| {
                tools
                    .iter()
                    .map(|t| {
                        format!(
                            "{} (score {}):\n{}",
                            t["name"].as_str().unwrap_or_default(),
                            t["score"],
                            t["declaration"].as_str().unwrap_or_default()
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        if lines.is_empty() {
            lines.push("no matching functions".into());
        }
        let mut result = CallToolResult::success(vec![ContentBlock::text(lines.join("\n\n"))]);
        result.structured_content = Some(found);
        Ok(result)
    }

    #[tool(
        description = "Run code in a sandbox (no network) and get its stdout and stderr, the \
images it made (PNG/JPEG inline) and download links for other files it wrote in /mnt/data. \
Languages: py, js, ts, c, cpp, java, php, rs, go, d, f90, r, bash. The result names a \
session_id: calls without session_id continue this connection's session (same files; Python \
keeps variables), and passing that session_id continues it from anywhere."
    )]
    async fn execute_code(
        &self,
        Parameters(args): Parameters<ExecuteCodeArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = caller_of(&ctx).await;
        Ok(self
            .execute(args, &caller, ctx.ct.clone())
            .await
            .unwrap_or_else(tool_error))
    }

    #[tool(
        description = "Put a file (base64 content) into a session's /mnt/data, where code run \
with execute_code finds it. Without session_id it goes to this connection's session. The \
result names the session_id to pass to later calls."
    )]
    async fn upload_file(
        &self,
        Parameters(args): Parameters<UploadFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = caller_of(&ctx).await;
        Ok(self.upload(args, &caller).await.unwrap_or_else(tool_error))
    }

    #[tool(
        description = "List the files in a session's /mnt/data (uploaded and generated), with \
sizes and download links. Pass the session_id from an earlier result, or leave it out for \
this connection's session."
    )]
    async fn list_files(
        &self,
        Parameters(args): Parameters<ListFilesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = caller_of(&ctx).await;
        Ok(self.list(args, &caller).await.unwrap_or_else(tool_error))
    }

    #[tool(
        description = "Read one file of a session by name: images come back as images, UTF-8 \
text as text, anything else as a download link. Pass the session_id from an earlier result, \
or leave it out for this connection's session."
    )]
    async fn read_file(
        &self,
        Parameters(args): Parameters<ReadFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = caller_of(&ctx).await;
        Ok(self.read(args, &caller).await.unwrap_or_else(tool_error))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for CodeTools {
    /// The router's tools, with the functions of code mode in `execute`'s description.
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut tools = self.tool_router.list_all();
        if self.codemode.enabled {
            let description = self.codemode.execute_description().await;
            for tool in tools.iter_mut().filter(|t| t.name == "execute") {
                tool.description = Some(description.clone().into());
            }
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("codebroker", env!("CARGO_PKG_VERSION"))
                    .with_title("codebroker code interpreter"),
            )
            .with_instructions(INSTRUCTIONS)
    }
}

/// The caller of a tool call, from the HTTP request rmcp attached to it (the auth layer
/// has already checked its credentials and put a JWT's user in its extensions).
async fn caller_of(ctx: &RequestContext<RoleServer>) -> Caller {
    let Some(parts) = ctx.extensions.get::<Parts>() else {
        return Caller::default();
    };
    let mut parts = parts.clone();
    Caller::from_request_parts(&mut parts, &())
        .await
        .unwrap_or_default()
}

/// A failed call as the model sees it: the API's message (internal details stay in the log).
fn tool_error(err: Error) -> CallToolResult {
    let message = err.client_message();
    CallToolResult::error(vec![ContentBlock::text(format!("Error: {message}"))])
}

/// A session id argument, blanks dropped and its shape checked.
fn session_arg(arg: Option<&str>) -> Result<Option<String>, Error> {
    match arg.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(id) if is_valid_id(id) => Ok(Some(id.to_string())),
        Some(id) => Err(Error::BadRequest(format!("invalid session_id: {id:?}"))),
    }
}

impl CodeTools {
    fn broker(&self) -> &Arc<Broker> {
        &self.state.broker
    }

    fn public_url(&self) -> &str {
        &self.broker().config.public_url
    }

    /// The session named by the argument, else this MCP session's; `None` when neither.
    async fn remembered_or(&self, arg: Option<&str>) -> Result<Option<String>, Error> {
        match session_arg(arg)? {
            Some(id) => Ok(Some(id)),
            None => Ok(self.session.lock().await.clone()),
        }
    }

    /// The codebroker session `open` gives for the one to continue (`explicit`, else this
    /// MCP session's), remembered as this MCP session's from then on. The memory stays
    /// locked meanwhile, so concurrent first calls share one session.
    async fn remembering<F, Fut>(
        &self,
        explicit: Option<String>,
        open: F,
    ) -> Result<Arc<Session>, Error>
    where
        F: FnOnce(Option<String>) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<Session>, Error>>,
    {
        let mut remembered = self.session.lock().await;
        let wanted = explicit.or_else(|| remembered.clone());
        let session = open(wanted).await?;
        *remembered = Some(session.id().to_string());
        Ok(session)
    }

    /// This MCP session's codebroker session (or `explicit`) for an exec by `caller`,
    /// admitted (the caller's exec rate) and made when there is none.
    async fn exec_session(
        &self,
        caller: &Caller,
        explicit: Option<String>,
    ) -> Result<Arc<Session>, Error> {
        let broker = self.broker();
        self.remembering(explicit, |wanted| {
            let choice = SessionChoice {
                user: caller.user.clone(),
                session_id: wanted,
                ..SessionChoice::default()
            };
            async move { broker.admit_exec(&choice, &[]).await }
        })
        .await
    }

    /// `execute`: the code in this MCP session's codebroker session, with code mode's
    /// functions; `{result, logs, error}` as text and structured content.
    async fn codemode_execute(
        &self,
        args: ExecuteArgs,
        caller: &Caller,
        cancel: CancellationToken,
    ) -> Result<CallToolResult, Error> {
        let lang = match args
            .lang
            .as_deref()
            .map(str::trim)
            .filter(|l| !l.is_empty())
        {
            None => Language::Js,
            Some(l) => match l.parse::<Language>() {
                Ok(lang @ (Language::Js | Language::Ts | Language::Py)) => lang,
                _ => {
                    return Err(Error::BadRequest(format!(
                        "code mode runs js, ts or py, not {l:?}"
                    )))
                }
            },
        };
        let broker = self.broker().clone();
        let session = self.exec_session(caller, None).await?;
        let outcome = self
            .codemode
            .run(broker, session, lang, &args.code, cancel)
            .await?;
        let value = outcome.to_json();
        let text = serde_json::to_string_pretty(&value).unwrap_or_else(|_| value.to_string());
        let mut result = if outcome.error.is_some() {
            CallToolResult::error(vec![ContentBlock::text(text)])
        } else {
            CallToolResult::success(vec![ContentBlock::text(text)])
        };
        result.structured_content = Some(value);
        Ok(result)
    }

    async fn execute(
        &self,
        args: ExecuteCodeArgs,
        caller: &Caller,
        cancel: CancellationToken,
    ) -> Result<CallToolResult, Error> {
        let lang: Language = args
            .lang
            .parse()
            .map_err(|_| Error::UnsupportedLanguage(args.lang.clone()))?;
        let explicit = session_arg(args.session_id.as_deref())?;
        let session = self.exec_session(caller, explicit).await?;
        let input = ExecInput {
            lang,
            code: args.code,
            args: args.args.unwrap_or_default(),
            timeout_ms: None,
            files: Vec::new(),
        };
        let hooks = ExecHooks {
            cancel: Some(cancel),
            ..ExecHooks::default()
        };
        let run = self.broker().spawn_exec(session, input, hooks);
        let session = run.session.clone();
        let output = run.await?;
        Ok(mcp_exec_result(&session, &output, self.public_url()).await)
    }

    async fn upload(&self, args: UploadFileArgs, caller: &Caller) -> Result<CallToolResult, Error> {
        let broker = self.broker().clone();
        let name = Broker::check_upload_name(&args.name)?;
        let bytes = decode_base64(&args.content_base64)?;
        let max_bytes = broker.config.max_upload_mb * 1024 * 1024;
        if bytes.len() as u64 > max_bytes {
            return Err(Error::TooLarge(format!(
                "{} is larger than the upload limit of {} MiB",
                args.name, broker.config.max_upload_mb
            )));
        }
        let user = caller.user.as_deref();
        let explicit = session_arg(args.session_id.as_deref())?;
        let broker = &broker;
        let session = self
            .remembering(explicit, |wanted| async move {
                let found = wanted
                    .as_deref()
                    .and_then(|id| broker.registry.get(id))
                    .filter(|s| s.visible_to(user));
                match found {
                    Some(s) => Ok(s),
                    None => broker.new_session(user, None, false).await,
                }
            })
            .await?;
        let staging = broker.staging_dir();
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| Error::internal(format!("cannot create staging dir: {e}")))?;
        let temp = staging.join(new_id());
        let staged = StagedFile {
            name,
            temp: temp.clone(),
            sha256: hex::encode(Sha256::digest(&bytes)),
            size: bytes.len() as u64,
        };
        let stored = match tokio::fs::write(&temp, &bytes).await {
            Ok(()) => {
                broker
                    .store_uploads(&session, vec![staged], UploadOptions::default())
                    .await
            }
            Err(e) => Err(Error::internal(format!("cannot stage upload: {e}"))),
        };
        // Gone after a successful store (moved into the session); removed otherwise.
        let _ = tokio::fs::remove_file(&temp).await;
        let records = stored?;
        let files: Vec<Value> = records
            .iter()
            .map(|r| {
                json!({
                    "id": r.id,
                    "name": r.name,
                    "path": format!("/mnt/data/{}", r.name),
                    "size": r.size,
                    "url": download_url(self.public_url(), session.id(), &r.id),
                })
            })
            .collect();
        let lines: Vec<String> = records
            .iter()
            .map(|r| format!("uploaded /mnt/data/{} ({} bytes)", r.name, r.size))
            .collect();
        let text = format!("{}\nsession_id: {}", lines.join("\n"), session.id());
        let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
        result.structured_content = Some(json!({ "session_id": session.id(), "files": files }));
        Ok(result)
    }

    /// The session a listing or a read is about: the argument's, else this MCP session's;
    /// 404 when the caller may not see it.
    async fn session_for_read(
        &self,
        arg: Option<&str>,
        caller: &Caller,
    ) -> Result<Arc<Session>, Error> {
        let Some(id) = self.remembered_or(arg).await? else {
            return Err(Error::BadRequest(
                "no session yet: pass the session_id of an earlier result".into(),
            ));
        };
        self.broker().visible_session(caller.user.as_deref(), &id)
    }

    async fn list(&self, args: ListFilesArgs, caller: &Caller) -> Result<CallToolResult, Error> {
        let session = self
            .session_for_read(args.session_id.as_deref(), caller)
            .await?;
        let broker = self.broker();
        let mut records: Vec<FileRecord> = session
            .index()
            .files
            .iter()
            .filter(|r| r.current && !broker.is_expired(r))
            .cloned()
            .collect();
        records.sort_by(|a, b| a.name.cmp(&b.name));
        let mut lines: Vec<String> = records
            .iter()
            .map(|r| {
                format!(
                    "/mnt/data/{} ({} bytes): {}",
                    r.name,
                    r.size,
                    download_url(self.public_url(), session.id(), &r.id)
                )
            })
            .collect();
        if lines.is_empty() {
            lines.push("(no files)".into());
        }
        lines.push(format!("session_id: {}", session.id()));
        let files: Vec<Value> = records
            .iter()
            .map(|r| {
                json!({
                    "id": r.id,
                    "name": r.name,
                    "path": format!("/mnt/data/{}", r.name),
                    "size": r.size,
                    "contentType": content_type(r.name.rsplit('/').next().unwrap_or(&r.name)),
                    "url": download_url(self.public_url(), session.id(), &r.id),
                })
            })
            .collect();
        let mut result = CallToolResult::success(vec![ContentBlock::text(lines.join("\n"))]);
        result.structured_content = Some(json!({ "session_id": session.id(), "files": files }));
        Ok(result)
    }

    async fn read(&self, args: ReadFileArgs, caller: &Caller) -> Result<CallToolResult, Error> {
        let session = self
            .session_for_read(args.session_id.as_deref(), caller)
            .await?;
        let name = args.name.trim();
        let name = name.strip_prefix("/mnt/data/").unwrap_or(name);
        let name = name.strip_prefix("./").unwrap_or(name);
        let record = session
            .index()
            .current(name)
            .filter(|r| !self.broker().is_expired(r))
            .cloned()
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "no file named {name:?} in session {}",
                    session.id()
                ))
            })?;
        let url = download_url(self.public_url(), session.id(), &record.id);
        let about = format!(
            "/mnt/data/{} ({} bytes): {url}\nsession_id: {}",
            record.name,
            record.size,
            session.id()
        );
        if let Some(mime) = inline_image_mime(&record.name) {
            if record.size <= MAX_INLINE_IMAGE_BYTES {
                let bytes = read_blob(&session, &record).await?;
                let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                return Ok(CallToolResult::success(vec![
                    ContentBlock::image(data, mime),
                    ContentBlock::text(about),
                ]));
            }
        } else if record.size <= MAX_INLINE_TEXT_BYTES {
            let bytes = read_blob(&session, &record).await?;
            if let Ok(text) = String::from_utf8(bytes) {
                return Ok(CallToolResult::success(vec![ContentBlock::text(text)]));
            }
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "not shown inline (binary or large); download: {about}"
        ))]))
    }
}

/// Base64 as models write it: standard or URL-safe alphabet, padded or not, line breaks
/// allowed, a `data:...;base64,` prefix tolerated.
fn decode_base64(text: &str) -> Result<Vec<u8>, Error> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let text = match text.split_once(";base64,") {
        Some((prefix, rest)) if prefix.starts_with("data:") => rest,
        _ => text,
    };
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(&compact).ok())
        .ok_or_else(|| Error::BadRequest("content_base64 is not valid base64".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_variants() {
        assert_eq!(decode_base64("aGk=").ok(), Some(b"hi".to_vec()));
        assert_eq!(decode_base64("aGk").ok(), Some(b"hi".to_vec()));
        assert_eq!(
            decode_base64("data:text/plain;base64,aG\nk=").ok(),
            Some(b"hi".to_vec())
        );
        assert_eq!(decode_base64("-_8").ok(), Some(vec![0xfb, 0xff]));
        assert!(decode_base64("***").is_err());
    }
}
