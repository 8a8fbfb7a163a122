//! `sandbox-runner tool-call NAME [JSON]`: the runner binary as a tool client, for bash
//! (whose tool functions run it) and for any program that can run a command.
//!
//! The input is the JSON argument, or else standard input (empty means `{}`). The call goes
//! over the exec's tool socket (`CODEBROKER_TOOL_SOCKET`). On success the result is printed
//! to stdout, a string as it is and anything else as JSON, with a newline, and the exit code
//! is 0; a failed tool prints its error message to stderr and exits 1; a usage error, or no
//! tool socket, exits 2.
//!
//! This mode is chosen before anything else in `main` and touches nothing of the agent:
//! no signal handlers, no `prctl`, no threads.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// The environment variable holding the exec's tool socket.
pub const SOCKET_ENV: &str = "CODEBROKER_TOOL_SOCKET";

/// The client's answer, as the runner writes it.
#[derive(serde::Deserialize)]
struct Answer {
    /// The tool's result.
    #[serde(default)]
    result: serde_json::Value,
    /// Whether the tool failed.
    #[serde(default)]
    is_error: bool,
    /// Why.
    #[serde(default)]
    error_message: Option<String>,
}

/// Runs the client with the arguments after `tool-call`; returns the exit code.
pub fn main(mut args: impl Iterator<Item = OsString>) -> i32 {
    let usage = "usage: sandbox-runner tool-call NAME [JSON]   (JSON from stdin when absent)";
    let Some(name) = args.next().and_then(|n| n.into_string().ok()) else {
        eprintln!("{usage}");
        return 2;
    };
    let arg = args.next();
    if args.next().is_some() {
        eprintln!("{usage}");
        return 2;
    }
    let text = match arg {
        Some(a) => match a.into_string() {
            Ok(s) => s,
            Err(_) => {
                eprintln!("{name}: the input is not valid UTF-8");
                return 2;
            }
        },
        None => {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                eprintln!("{name}: cannot read the input from stdin: {e}");
                return 2;
            }
            s
        }
    };
    let input: serde_json::Value = if text.trim().is_empty() {
        serde_json::json!({})
    } else {
        match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("{name}: the input is not valid JSON: {e}");
                return 2;
            }
        }
    };
    let Some(socket) = std::env::var_os(SOCKET_ENV).filter(|s| !s.is_empty()) else {
        eprintln!("{name}: no tool socket ({SOCKET_ENV} is not set: this exec has no tools)");
        return 2;
    };
    match call(&socket, &name, input) {
        Ok(answer) if answer.is_error => {
            let msg = answer
                .error_message
                .unwrap_or_else(|| format!("Tool '{name}' failed"));
            // One write, so the message arrives in one piece.
            let _ = std::io::stderr().write_all(format!("{msg}\n").as_bytes());
            1
        }
        Ok(answer) => {
            let mut text = match answer.result {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            if !text.ends_with('\n') {
                text.push('\n');
            }
            let mut out = std::io::stdout().lock();
            if out
                .write_all(text.as_bytes())
                .and_then(|_| out.flush())
                .is_err()
            {
                return 1;
            }
            0
        }
        Err(e) => {
            eprintln!("{name}: tool call failed: {e}");
            1
        }
    }
}

/// Sends one call and reads its answer.
fn call(socket: &OsString, name: &str, input: serde_json::Value) -> std::io::Result<Answer> {
    let mut stream = UnixStream::connect(socket)?;
    let mut line = serde_json::to_vec(&serde_json::json!({"name": name, "input": input}))?;
    line.push(b'\n');
    stream.write_all(&line)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply)?;
    if reply.is_empty() {
        return Err(std::io::Error::other("no answer (is the exec over?)"));
    }
    Ok(serde_json::from_slice(&reply)?)
}
