//! rmcp's client on a test broker's `/mcp`, for the suites that speak MCP (`mcp.rs`,
//! `codemode.rs`, `hostile_stream.rs`). Included by path from those only, so the other
//! suites do not compile it.

#![allow(dead_code)]

use crate::common::TestBroker;
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;

/// An initialized MCP client: one MCP session.
pub type Client = RunningService<RoleClient, ClientConfig>;

/// An MCP client on the broker's `/mcp`, initialized, with `key` as its bearer key.
pub async fn connect(broker: &TestBroker, key: Option<&str>) -> Result<Client, String> {
    connect_to(&broker.url("/mcp"), key).await
}

/// An MCP client on `url` (any broker's `/mcp`, a child process's too), initialized,
/// with `key` as its bearer key.
pub async fn connect_to(url: &str, key: Option<&str>) -> Result<Client, String> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(url.to_string());
    if let Some(key) = key {
        config = config.auth_header(key);
    }
    let transport = StreamableHttpClientTransport::from_config(config);
    ClientConfig::default()
        .serve(transport)
        .await
        .map_err(|e| e.to_string())
}

/// Calls `tool` with `args` (an object); panics if the call itself fails.
pub async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let Value::Object(args) = args else {
        panic!("arguments must be an object");
    };
    client
        .call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool} failed: {e}"))
}

/// All text blocks of a result, joined.
pub fn text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A result's `structuredContent`.
pub fn structured(result: &CallToolResult) -> &Value {
    result
        .structured_content
        .as_ref()
        .expect("structuredContent")
}
