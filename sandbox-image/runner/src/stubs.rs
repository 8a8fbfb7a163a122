//! Client stubs for tools in bash and JavaScript/TypeScript (Python's are made by the
//! kernel): the prelude files the runner writes next to the tool socket for each exec that
//! has tools, and the async wrapper that gives plain JavaScript top-level `await`.
//!
//! Function names are derived from tool names the same way in every language: characters
//! other than ASCII letters, digits and `_` become `_`, a leading digit gets a `_` in front,
//! and a name the language would not let a function have, or that would hide something the
//! code is likely to need (a keyword, a shell builtin, a command on `PATH`, a JavaScript
//! global), gets a `_tool` suffix. Two tools that end up with the same name get `_2`, `_3`.

use sandbox_runner::ToolSpec;
use std::collections::HashSet;
use std::ffi::OsStr;

/// Bash's reserved words and builtins: a function of that name would hide them.
const BASH_RESERVED: &str = "if then else elif fi case esac for select while until do done in \
    function time coproc alias bg bind break builtin caller cd command compgen complete compopt \
    continue declare dirs disown echo enable eval exec exit export false fc fg getopts hash help \
    history jobs kill let local logout mapfile popd printf pushd pwd read readarray readonly \
    return set shift shopt source suspend test times trap true type typeset ulimit umask unalias \
    unset wait";

/// An ASCII identifier made from a tool name: other characters become `_`, and a leading
/// digit (or nothing at all) gets a `_` in front.
pub fn base_identifier(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    s
}

/// Makes `name` unique among `taken` by appending `_2`, `_3`, ...; records it.
fn unique(name: String, taken: &mut HashSet<String>) -> String {
    let mut candidate = name.clone();
    let mut n = 2;
    while taken.contains(&candidate) {
        candidate = format!("{name}_{n}");
        n += 1;
    }
    taken.insert(candidate.clone());
    candidate
}

/// The bash function names of `tools`, in order. `path` is the programs' `PATH`: a tool
/// named like a command on it gets the suffix, so it cannot shadow `ls` or `grep`.
pub fn bash_names(tools: &[ToolSpec], path: &OsStr) -> Vec<String> {
    let mut taken = HashSet::new();
    tools
        .iter()
        .map(|t| {
            let mut name = base_identifier(&t.name);
            if BASH_RESERVED.split_whitespace().any(|w| w == name)
                || crate::spawn::resolve(&name, path).is_some()
            {
                name.push_str("_tool");
            }
            unique(name, &mut taken)
        })
        .collect()
}

/// Quotes `s` for bash as one word.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The file bash sources through `BASH_ENV`: one function per tool, each running the runner
/// binary as a client (`sandbox-runner tool-call NAME [JSON]`).
pub fn bash_prelude(tools: &[ToolSpec], path: &OsStr, runner: &str) -> String {
    let mut out = String::from(
        "# Tool functions of this exec, made by sandbox-runner. Usage: NAME '{\"key\": 1}'\n\
         # or: echo '{\"key\": 1}' | NAME. The result is printed (strings as they are, other\n\
         # values as JSON); a failed tool prints its error to stderr and returns 1.\n",
    );
    let runner = shell_quote(runner);
    for (tool, func) in tools.iter().zip(bash_names(tools, path)) {
        for line in tool.description.lines().take(20) {
            out.push_str("# ");
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&format!(
            "{func}() {{ {runner} tool-call {} \"$@\"; }}\n",
            shell_quote(&tool.name)
        ));
    }
    out
}

/// The file node preloads (`node -r prelude.js`): an async function per tool on
/// `globalThis` and on `globalThis.codemode` (under the tool's own name), and `ToolError`.
/// `esm_main` is the compiled TypeScript module when it runs as ES module: it gets the
/// CommonJS globals (`require`, `__filename`, `__dirname`) it would otherwise lack.
pub fn js_prelude(tools: &[ToolSpec], socket: &str, esm_main: Option<&str>) -> String {
    let specs: Vec<serde_json::Value> = tools
        .iter()
        .map(|t| {
            serde_json::json!({
                "name": t.name,
                "base": base_identifier(&t.name),
                "description": t.description,
                "parameters": t.parameters,
            })
        })
        .collect();
    let mut out = String::new();
    out.push_str("// Tool functions of this exec, made by sandbox-runner.\n");
    out.push_str(&format!("const SOCKET = {};\n", json(socket)));
    out.push_str(&format!(
        "const TOOLS = {};\n",
        json(&serde_json::Value::Array(specs))
    ));
    out.push_str(&format!(
        "const ESM_MAIN = {};\n",
        json(&esm_main.map(str::to_string))
    ));
    out.push_str(JS_PRELUDE_BODY);
    out
}

/// A value as JSON text (JSON values, strings and options of strings cannot fail to
/// encode; `null` just in case).
fn json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

/// The fixed part of the JavaScript prelude (see `js_prelude`).
const JS_PRELUDE_BODY: &str = r#"
(() => {
  "use strict";
  const net = require("net");
  const RESERVED = new Set(("break case catch class const continue debugger default delete do else " +
    "enum export extends false finally for function if import in instanceof new null return super " +
    "switch this throw true try typeof var void while with yield let static implements interface " +
    "package private protected public await arguments eval undefined NaN Infinity require module " +
    "exports __filename __dirname codemode ToolError").split(" "));

  class ToolError extends Error {
    constructor(message, tool) {
      super(message);
      this.name = "ToolError";
      this.tool = tool;
    }
  }

  // Calls made in the same synchronous step (`Promise.all([a(), b()])`) are sent
  // together once the step ends, each naming the step and its size, so the broker answers
  // them as one batch.
  let step = null;
  let steps = 0;
  function inStep(start) {
    if (step === null) {
      const current = { id: `js-${++steps}`, starts: [] };
      step = current;
      process.nextTick(() => {
        step = null;
        const size = current.starts.length;
        for (const go of current.starts) go(size > 1 ? { id: current.id, size } : undefined);
      });
    }
    step.starts.push(start);
  }

  function callTool(name, input) {
    return new Promise((resolve, reject) => inStep((batch) => {
      let line;
      try {
        line = JSON.stringify({ name, input: input === undefined ? {} : input, batch }) + "\n";
      } catch (e) {
        reject(e);
        return;
      }
      const chunks = [];
      let failed = null;
      const sock = net.createConnection(SOCKET);
      sock.on("connect", () => sock.write(line));
      sock.on("data", (c) => chunks.push(c));
      sock.on("error", (e) => { failed = e; });
      sock.on("close", () => {
        const text = Buffer.concat(chunks).toString("utf8");
        let answer = null;
        try {
          answer = text ? JSON.parse(text) : null;
        } catch (e) {
          answer = null;
        }
        if (answer === null || typeof answer !== "object") {
          const why = failed ? failed.message : "no answer (is the exec over?)";
          reject(new ToolError(`tool '${name}': ${why}`, name));
        } else if (answer.is_error) {
          reject(new ToolError(answer.error_message || `tool '${name}' failed`, name));
        } else {
          resolve(answer.result === undefined ? null : answer.result);
        }
      });
    }));
  }

  const codemode = {};
  const taken = new Set();
  for (const tool of TOOLS) {
    const fn = async function (input) {
      return callTool(tool.name, input);
    };
    Object.defineProperty(fn, "name", { value: tool.name });
    fn.description = tool.description;
    fn.parameters = tool.parameters;
    codemode[tool.name] = fn;
    let id = tool.base;
    if (RESERVED.has(id) || id in globalThis) id += "_tool";
    let unique = id;
    for (let n = 2; taken.has(unique); n++) unique = `${id}_${n}`;
    taken.add(unique);
    globalThis[unique] = fn;
  }
  globalThis.codemode = codemode;
  globalThis.ToolError = ToolError;

  if (ESM_MAIN !== null) {
    const path = require("path");
    globalThis.require = require("module").createRequire(ESM_MAIN);
    globalThis.__filename = ESM_MAIN;
    globalThis.__dirname = path.dirname(ESM_MAIN);
  }
})();
"#;

/// What the wrapper of [`wrap_js`] does with an error that escapes the code.
const JS_UNCAUGHT: &str =
    r#"process.stderr.write(require("util").format(e) + "\n"); process.exit(1);"#;

/// Plain JavaScript with tools runs inside an async function, for top-level `await`
/// (CommonJS has none). A `#!` line stays first and the code starts on its own line number,
/// so line numbers in stack traces match. An error that escapes is printed to stderr the
/// way node prints an uncaught exception (its stack and properties; node's excerpt of the
/// source line would only show this wrapper) and the process exits with code 1 at once.
pub fn wrap_js(code: &str) -> String {
    let (shebang, body) = match code.strip_prefix("#!") {
        Some(_) => match code.find('\n') {
            Some(i) => {
                let (a, b) = code.split_at(i + 1);
                (a.to_string(), b)
            }
            None => (format!("{code}\n"), ""),
        },
        None => (String::new(), code),
    };
    format!("{shebang}(async () => {{ {body}\n}})().catch((e) => {{ {JS_UNCAUGHT} }});\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: "Adds.\nTwo numbers.".into(),
            parameters: serde_json::json!({"type": "object"}),
        }
    }

    #[test]
    fn identifiers() {
        assert_eq!(base_identifier("add"), "add");
        assert_eq!(base_identifier("web-search.v2"), "web_search_v2");
        assert_eq!(base_identifier("2fa"), "_2fa");
        assert_eq!(base_identifier(""), "_");
        assert_eq!(base_identifier("héllo"), "h_llo");
    }

    #[test]
    fn bash_names_avoid_builtins_commands_and_duplicates() {
        let tools = [
            tool("add"),
            tool("read"),
            tool("sh"),
            tool("a-b"),
            tool("a_b"),
            tool("if"),
        ];
        let names = bash_names(&tools, OsStr::new("/bin:/usr/bin"));
        assert_eq!(
            names,
            vec!["add", "read_tool", "sh_tool", "a_b", "a_b_2", "if_tool"]
        );
    }

    #[test]
    fn bash_prelude_quotes_everything() {
        let tools = [tool("it's")];
        let text = bash_prelude(&tools, OsStr::new(""), "/opt/x y/sandbox-runner");
        assert!(text.contains("# Adds.\n# Two numbers.\n"), "{text}");
        assert!(
            text.contains("it_s() { '/opt/x y/sandbox-runner' tool-call 'it'\\''s' \"$@\"; }\n"),
            "{text}"
        );
    }

    #[test]
    fn js_wrapper_keeps_shebang_and_lines() {
        assert_eq!(
            wrap_js("await f();"),
            format!("(async () => {{ await f();\n}})().catch((e) => {{ {JS_UNCAUGHT} }});\n")
        );
        let w = wrap_js("#!/usr/bin/env node\nx();");
        assert!(
            w.starts_with("#!/usr/bin/env node\n(async () => { x();\n"),
            "{w}"
        );
        assert!(wrap_js("#!node").starts_with("#!node\n(async"));
    }

    #[test]
    fn js_prelude_embeds_json() {
        let text = js_prelude(&[tool("a\"b")], "/tmp/t/s.sock", Some("/tmp/x/main.mjs"));
        assert!(text.contains("const SOCKET = \"/tmp/t/s.sock\";"), "{text}");
        assert!(text.contains("\"name\":\"a\\\"b\""), "{text}");
        assert!(text.contains("const ESM_MAIN = \"/tmp/x/main.mjs\";"));
        let text = js_prelude(&[], "/s", None);
        assert!(text.contains("const ESM_MAIN = null;"));
    }
}
