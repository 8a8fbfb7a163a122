//! The functions as the code's author reads them: TypeScript declarations and Python
//! stubs generated from the tools' JSON Schemas.

use sandbox_runner::ToolSpec;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// How deep JSON Schemas are turned into types.
const MAX_SCHEMA_DEPTH: usize = 6;

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
pub(super) fn ts_type(schema: &Value, depth: usize) -> String {
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
pub(super) fn declaration(spec: &ToolSpec, output: Option<&Value>) -> String {
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
pub(super) fn typescript_declarations(
    specs: &[ToolSpec],
    outputs: &BTreeMap<String, Value>,
) -> String {
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
pub(super) fn python_stubs(specs: &[ToolSpec]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp::codemode::fetch::builtin_specs;
    use serde_json::json;

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
}
