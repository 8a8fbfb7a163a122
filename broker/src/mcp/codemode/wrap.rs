//! The code wrapped around the caller's: it builds `codemode.<ns>.<name>` from the flat tool
//! names, runs the code, and reports its value and error through [`RESULT_TOOL`].
//!
//! The wrappers are the files beside this one. Their placeholders (`@REPORT@`, `@SOURCE@`,
//! `@CODE@`) are replaced here; the caller's code goes in last, so that nothing it contains
//! is taken for a placeholder.

use super::RESULT_TOOL;
use serde_json::Value;

/// Builds `codemode.<ns>.<rest>` from the flat `codemode["ns.rest"]` the runner's prelude
/// defines, and takes the result reporter out of sight. JavaScript, valid TypeScript too.
const SETUP: &str = include_str!("wrap_setup.ts");
/// The JavaScript wrapper after [`SETUP`].
const JS: &str = include_str!("wrap.js");
/// The TypeScript wrapper after [`SETUP`].
const TS: &str = include_str!("wrap.ts");
/// The Python wrapper.
const PY: &str = include_str!("wrap.py");

/// [`RESULT_TOOL`] as a JSON string literal, which JavaScript and Python read alike.
fn report_literal() -> String {
    Value::String(RESULT_TOOL.into()).to_string()
}

/// [`SETUP`] for TypeScript.
fn ts_setup() -> String {
    SETUP.replace("@REPORT@", &report_literal())
}

/// The JavaScript/TypeScript typing in [`SETUP`] removed, for plain JavaScript.
fn js_setup() -> String {
    ts_setup().replace(": any", "").replace(" as any", "")
}

/// JavaScript: the code is a lone expression (`return`ed, a function is called) or a
/// function body; either way it sees `require` and friends. The runner runs this inside an
/// async function.
pub(super) fn wrap_js(code: &str) -> String {
    let source = Value::String(code.to_string()).to_string();
    format!("{}\n{}", js_setup(), JS.replace("@SOURCE@", &source))
}

/// TypeScript (compiled to an ES module, which has top-level `await`): the code is a
/// function body; `return` gives the result.
pub(super) fn wrap_ts(code: &str) -> String {
    format!("{}\n{}", ts_setup(), TS.replace("@CODE@", code))
}

/// Python: the code runs like a cell (top-level `await` allowed) in the kernel's globals,
/// its last expression is the result; `codemode.<ns>.<name>` is built from the kernel's tool
/// functions.
pub(super) fn wrap_py(code: &str) -> String {
    let source = Value::String(code.to_string()).to_string();
    PY.replace("@REPORT@", &report_literal())
        .replace("@SOURCE@", &source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn js_setup_has_no_types() {
        let js = js_setup();
        assert!(!js.contains(": any") && !js.contains("as any"), "{js}");
        assert!(js.contains("cm[\"__codemode_result\"]"), "{js}");
    }
}
