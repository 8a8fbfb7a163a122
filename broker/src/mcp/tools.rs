//! The MCP tools (`execute_code`, `upload_file`, `list_files`, `read_file`, and code
//! mode's `execute` and `search`) and the MCP session's memory of its codebroker session;
//! the file tools' work is in `files.rs`.

use crate::core::Admitted;
use crate::core::{Broker, Error, ExecHooks, ExecInput, SessionChoice};
use crate::http::auth::Caller;
use crate::http::AppState;
use crate::ids::is_valid_id;
use crate::mcp::codemode::CodeMode;
use crate::render::mcp_exec_result;
use crate::session::Session;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
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
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// What the server tells clients at `initialize`.
const INSTRUCTIONS: &str = "codebroker runs code in a locked-down sandbox with no network. \
Files live in /mnt/data (the working directory) and persist across calls in the same session; \
Python keeps its variables between calls too. Every result names its session_id: calls \
without session_id continue this connection's session, and passing a session_id continues \
that session.";

/// `execute_code` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct ExecuteCodeArgs {
    /// The language, by the names of the language table.
    #[schemars(description = format!(
        "Language: {} (python, javascript, typescript, sh and the like work too).",
        Language::names(" or ")
    ))]
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
        description = format!("Run code in a sandbox (no network) and get its stdout and stderr, \
the images it made (PNG/JPEG inline) and download links for other files it wrote in \
/mnt/data. Languages: {}. The result names a session_id: calls without session_id continue \
this connection's session (same files; Python keeps variables), and passing that session_id \
continues it from anywhere.", Language::names(", "))
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
pub(super) fn session_arg(arg: Option<&str>) -> Result<Option<String>, Error> {
    match arg.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(id) if is_valid_id(id) => Ok(Some(id.to_string())),
        Some(id) => Err(Error::BadRequest(format!("invalid session_id: {id:?}"))),
    }
}

impl CodeTools {
    pub(super) fn broker(&self) -> &Arc<Broker> {
        &self.state.broker
    }

    pub(super) fn public_url(&self) -> &str {
        &self.broker().config().public_url
    }

    /// The session named by the argument, else this MCP session's; `None` when neither.
    pub(super) async fn remembered_or(&self, arg: Option<&str>) -> Result<Option<String>, Error> {
        match session_arg(arg)? {
            Some(id) => Ok(Some(id)),
            None => Ok(self.session.lock().await.clone()),
        }
    }

    /// The codebroker session `open` gives for the one to continue (`explicit`, else this
    /// MCP session's), remembered as this MCP session's from then on. The memory stays
    /// locked meanwhile, so concurrent first calls share one session.
    pub(super) async fn remembering<F, Fut, T>(
        &self,
        explicit: Option<String>,
        open: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(Option<String>) -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
        T: AsRef<Session>,
    {
        let mut remembered = self.session.lock().await;
        let wanted = explicit.or_else(|| remembered.clone());
        let opened = open(wanted).await?;
        *remembered = Some(opened.as_ref().id().to_string());
        Ok(opened)
    }

    /// This MCP session's codebroker session (or `explicit`) for an exec by `caller`,
    /// admitted (the caller's exec rate) and made when there is none.
    async fn exec_session(
        &self,
        caller: &Caller,
        explicit: Option<String>,
    ) -> Result<Admitted, Error> {
        let broker = self.broker();
        // An MCP client names no user for the people behind it: LobeChat's rule, so a
        // leaked id of a named user's session starts a new one.
        let explicit = broker.front_end_session_id(caller.user.as_deref(), explicit);
        self.remembering(explicit, |wanted| {
            let choice = SessionChoice {
                user: caller.user.clone(),
                session_id: wanted,
                tenant: caller.tenant.clone(),
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
        let admitted = self.exec_session(caller, None).await?;
        let outcome = self
            .codemode
            .run(broker, admitted, lang, &args.code, cancel)
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
        let admitted = self.exec_session(caller, explicit).await?;
        let input = ExecInput {
            lang,
            code: args.code,
            args: args.args.unwrap_or_default(),
            timeout_ms: None,
            files: Vec::new(),
            tenant: caller.tenant.clone(),
            rich: false,
        };
        let hooks = ExecHooks {
            cancel: Some(cancel),
            ..ExecHooks::default()
        };
        let run = self.broker().spawn_exec(admitted, input, hooks);
        let session = run.session.clone();
        let output = run.await?;
        Ok(mcp_exec_result(&session, &output, self.public_url()).await)
    }
}
