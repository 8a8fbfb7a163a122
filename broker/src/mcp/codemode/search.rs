//! `search`: the functions ranked against a query.

use super::RESULT_TOOL;
use sandbox_runner::ToolSpec;

/// Most tools `search` returns.
const MAX_SEARCH_HITS: usize = 10;

/// `specs` that match `query`, with their scores, best first (name matches count more than
/// description matches); every function when the query is blank.
pub(super) fn rank<'a>(specs: &'a [ToolSpec], query: &str) -> Vec<(&'a ToolSpec, u32)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp::codemode::fetch::builtin_specs;
    use serde_json::json;

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
}
