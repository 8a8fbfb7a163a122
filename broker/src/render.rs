//! What a model or a client reads of an exec and its files, in every front end's shape:
//! the `/exec` JSON answer, LobeChat's markdown, MCP's content blocks, download links and
//! MIME types. `http/` and `mcp/` both render through here.

use crate::core::{Delivery, Error, ExecOutput, Verdict};
use crate::session::Session;
use crate::workspace::FileRecord;
use base64::Engine as _;
use rmcp::model::{CallToolResult, ContentBlock};
use sandbox_runner::RuntimeStatus;
use serde_json::{json, Value};

/// Largest image sent inline as an `image` block; larger ones are links.
pub(crate) const MAX_INLINE_IMAGE_BYTES: u64 = 5 * 1024 * 1024;

/// The `/exec` response (docs/API.md, "POST /exec").
pub(crate) fn output_json(output: &ExecOutput) -> Value {
    let files: Vec<Value> = output
        .files
        .iter()
        .map(|f| {
            let mut file = json!({
                "id": f.id,
                "name": f.name,
                "path": format!("/mnt/data/{}", f.name),
                "storage_session_id": output.session_id,
                "session_id": output.session_id,
                "size": f.size,
            });
            if let Some(previous) = &f.modified_from {
                file["modified_from"] = json!(previous);
            }
            file
        })
        .collect();
    let mut body = json!({
        "session_id": output.session_id,
        "stdout": output.stdout,
        "stderr": output.stderr,
        "files": files,
        "runtime_session_id": output.session_id,
        "runtime_status": match output.runtime_status {
            RuntimeStatus::New => "new",
            RuntimeStatus::Reused => "reused",
        },
        "exit_code": output.exit_code,
        "duration_ms": output.duration_ms,
        "limits": output.limits.iter().map(|l| l.message()).collect::<Vec<_>>(),
    });
    // Both only when there is something to say, as LibreChat's own code server does.
    if !output.deleted_files.is_empty() {
        body["deleted_files"] = json!(output.deleted_files);
    }
    if let Some(failure) = artifact_delivery(output.delivery) {
        body["artifact_delivery"] = failure;
    }
    body
}

/// `artifact_delivery` of the `/exec` response when files the exec made were not kept:
/// `{code: "artifact_delivery_failed", status, attempted, delivered, failed}`, with
/// `status` `failed` exactly when none was kept, else `partial`. `@librechat/agents`
/// drops any other shape (a zero `failed`, counts that do not add up), so there is none.
fn artifact_delivery(delivery: Delivery) -> Option<Value> {
    if delivery.failed == 0 || delivery.failed > delivery.attempted {
        return None;
    }
    let delivered = delivery.delivered();
    Some(json!({
        "code": "artifact_delivery_failed",
        "status": if delivered == 0 { "failed" } else { "partial" },
        "attempted": delivery.attempted,
        "delivered": delivered,
        "failed": delivery.failed,
    }))
}

/// The absolute URL a file version downloads from.
pub(crate) fn download_url(public_url: &str, session_id: &str, file_id: &str) -> String {
    format!(
        "{}/download/{session_id}/{file_id}",
        public_url.trim_end_matches('/')
    )
}

/// The MIME type of an image clients can show inline, or `None` for other files.
pub(crate) fn inline_image_mime(name: &str) -> Option<&'static str> {
    let base = name.rsplit('/').next().unwrap_or(name);
    match content_type(base) {
        mime @ ("image/png" | "image/jpeg" | "image/gif" | "image/webp") => Some(mime),
        _ => None,
    }
}

/// A file's bytes from the session's blob store.
pub(crate) async fn read_blob(session: &Session, record: &FileRecord) -> Result<Vec<u8>, Error> {
    tokio::fs::read(session.workspace.blob_path(&record.sha256))
        .await
        .map_err(|_| Error::NotFound(format!("file {:?} not found", record.name)))
}

/// How an exec that did not succeed ended, in the words of LibreChat's programmatic
/// contract, which every front end uses: the limits hit, else `Sandbox exited with code
/// N`, else `Execution failed or timed out`. `None` when it succeeded.
pub(crate) fn verdict_text(output: &ExecOutput) -> Option<String> {
    match output.verdict() {
        Verdict::Ok => None,
        Verdict::Limit(limits) => Some(
            limits
                .iter()
                .map(|l| l.message())
                .collect::<Vec<_>>()
                .join("; "),
        ),
        Verdict::Failed(code) => Some(format!("Sandbox exited with code {code}")),
        Verdict::Stopped => Some("Execution failed or timed out".to_string()),
    }
}

/// The end of a text summary of an exec (MCP, LobeChat): its exit code when not 0, or
/// that it did not finish, and the limits it hit; one line each.
fn ending_lines(output: &ExecOutput) -> Vec<String> {
    let mut lines = Vec::new();
    match output.exit_code {
        Some(0) => {}
        Some(code) => lines.push(format!("Exit code: {code}")),
        None => lines.push("The program did not finish.".to_string()),
    }
    if !output.limits.is_empty() {
        let limits: Vec<&str> = output.limits.iter().map(|l| l.message()).collect();
        lines.push(format!("Limits hit: {}", limits.join(", ")));
    }
    lines
}

/// `execute_code`'s result: output text, images inline, links to other files, the
/// `/exec` response as structured content, and `isError` when the code failed.
pub(crate) async fn mcp_exec_result(
    session: &Session,
    output: &ExecOutput,
    public_url: &str,
) -> CallToolResult {
    let failed = !output.verdict().is_ok();
    let mut text = String::new();
    if !output.stdout.is_empty() {
        text.push_str("stdout:\n");
        text.push_str(&output.stdout);
        if !output.stdout.ends_with('\n') {
            text.push('\n');
        }
    }
    if !output.stderr.is_empty() {
        text.push_str("stderr:\n");
        text.push_str(&output.stderr);
        if !output.stderr.ends_with('\n') {
            text.push('\n');
        }
    }
    if text.is_empty() {
        text.push_str("(no output)\n");
    }
    for line in ending_lines(output) {
        text.push_str(&line);
        text.push('\n');
    }
    let mut content = vec![ContentBlock::text(text)];
    let mut links = Vec::new();
    for file in &output.files {
        let url = download_url(public_url, &output.session_id, &file.id);
        let image = inline_image_mime(&file.name).filter(|_| file.size <= MAX_INLINE_IMAGE_BYTES);
        if let Some(mime) = image {
            if let Ok(bytes) = read_blob(session, file).await {
                let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                content.push(ContentBlock::image(data, mime));
                links.push(format!(
                    "image /mnt/data/{} ({} bytes): {url}",
                    file.name, file.size
                ));
                continue;
            }
        }
        links.push(format!(
            "file /mnt/data/{} ({} bytes): {url}",
            file.name, file.size
        ));
    }
    links.push(format!(
        "session_id: {} (calls without session_id continue it; pass it to continue it elsewhere)",
        output.session_id
    ));
    content.push(ContentBlock::text(links.join("\n")));
    let mut result = if failed {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    };
    result.structured_content = Some(output_json(output));
    result
}

/// The answer: output in fenced blocks, images as `![](url)`, other files as links, and
/// the session to pass next time.
pub(crate) fn lobe_markdown(output: &ExecOutput, public_url: &str) -> String {
    let mut md = String::new();
    if !output.stdout.is_empty() {
        md.push_str("stdout:\n\n");
        md.push_str(&fenced(&output.stdout));
    }
    if !output.stderr.is_empty() {
        md.push_str("stderr:\n\n");
        md.push_str(&fenced(&output.stderr));
    }
    if md.is_empty() {
        md.push_str("(no output)\n\n");
    }
    for line in ending_lines(output) {
        md.push_str(&line);
        md.push_str("\n\n");
    }
    let (images, others): (Vec<_>, Vec<_>) = output
        .files
        .iter()
        .partition(|f| inline_image_mime(&f.name).is_some());
    for image in images {
        let url = download_url(public_url, &output.session_id, &image.id);
        md.push_str(&format!("![{}]({url})\n\n", link_text(&image.name)));
    }
    if !others.is_empty() {
        md.push_str("Files:\n\n");
        for file in others {
            let url = download_url(public_url, &output.session_id, &file.id);
            md.push_str(&format!(
                "- [{}]({url}) ({} bytes)\n",
                link_text(&file.name),
                file.size
            ));
        }
        md.push('\n');
    }
    md.push_str(&format!(
        "session_id: `{}` (pass it as session_id in the next runCode call to keep variables \
and files)\n",
        output.session_id
    ));
    md
}

/// A fenced code block whose fence is longer than any run of backticks in `text`.
fn fenced(text: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in text.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    let fence = "`".repeat(longest.max(2) + 1);
    let newline = if text.ends_with('\n') { "" } else { "\n" };
    format!("{fence}text\n{text}{newline}{fence}\n\n")
}

/// A file name as markdown link text: brackets and backslashes escaped.
fn link_text(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A MIME type from a file name's extension.
pub(crate) fn content_type(name: &str) -> &'static str {
    let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("svg") => "image/svg+xml",
        Some("webp") => "image/webp",
        Some("pdf") => "application/pdf",
        Some("csv") => "text/csv",
        Some("txt" | "log" | "md") => "text/plain; charset=utf-8",
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("json") => "application/json",
        Some("xml") => "application/xml",
        Some("zip") => "application/zip",
        Some("xlsx") => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        Some("docx") => "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        Some("pptx") => "application/vnd.openxmlformats-officedocument.presentationml.presentation",
        Some("doc") => "application/msword",
        Some("xls") => "application/vnd.ms-excel",
        Some("ppt") => "application/vnd.ms-powerpoint",
        Some("odt") => "application/vnd.oasis.opendocument.text",
        Some("ods") => "application/vnd.oasis.opendocument.spreadsheet",
        Some("odp") => "application/vnd.oasis.opendocument.presentation",
        Some("rtf") => "application/rtf",
        Some("epub") => "application/epub+zip",
        Some("parquet") => "application/vnd.apache.parquet",
        Some("tsv") => "text/tab-separated-values",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::Origin;

    #[test]
    fn download_urls_are_absolute() {
        assert_eq!(
            download_url("http://127.0.0.1:8000/", "S", "F"),
            "http://127.0.0.1:8000/download/S/F"
        );
    }

    #[test]
    fn office_and_document_types_by_extension() {
        assert_eq!(
            content_type("deck.PPTX"),
            "application/vnd.openxmlformats-officedocument.presentationml.presentation"
        );
        assert_eq!(
            content_type("report.odt"),
            "application/vnd.oasis.opendocument.text"
        );
        assert_eq!(content_type("old.xls"), "application/vnd.ms-excel");
        assert_eq!(content_type("notes.rtf"), "application/rtf");
        assert_eq!(content_type("book.epub"), "application/epub+zip");
        assert_eq!(content_type("no-extension"), "application/octet-stream");
    }

    #[test]
    fn images_by_extension() {
        assert_eq!(inline_image_mime("charts/a.PNG"), Some("image/png"));
        assert_eq!(inline_image_mime("x.jpeg"), Some("image/jpeg"));
        assert_eq!(inline_image_mime("x.svg"), None);
        assert_eq!(inline_image_mime("data.csv"), None);
    }

    #[test]
    fn fences_outgrow_the_backticks_inside() {
        assert_eq!(fenced("hi\n"), "```text\nhi\n```\n\n");
        assert_eq!(fenced("a ```` b"), "`````text\na ```` b\n`````\n\n");
    }

    fn record(name: &str) -> FileRecord {
        FileRecord {
            id: format!("{name:_>21}").chars().take(21).collect(),
            name: name.into(),
            size: 3,
            sha256: String::new(),
            created_ms: 0,
            stamp: Default::default(),
            current: true,
            origin: Origin::Generated,
            read_only: false,
            kind: None,
            modified_from: None,
        }
    }

    #[test]
    fn markdown_has_output_images_links_and_session() {
        let output = crate::core::ExecOutput {
            session_id: "S".repeat(21),
            stdout: "42\n".into(),
            stderr: String::new(),
            files: vec![record("plot.png"), record("out[1].csv")],
            runtime_status: sandbox_runner::RuntimeStatus::New,
            exit_code: Some(0),
            duration_ms: 1,
            limits: vec![],
            compile_cached: None,
            deleted_files: vec![],
            delivery: Delivery::default(),
        };
        let md = lobe_markdown(&output, "https://x.example/");
        let s = "S".repeat(21);
        assert!(md.starts_with("stdout:\n\n```text\n42\n```\n"), "{md}");
        assert!(
            md.contains(&format!(
                "![plot.png](https://x.example/download/{s}/{})",
                output.files[0].id
            )),
            "{md}"
        );
        assert!(
            md.contains("- [out\\[1\\].csv](https://x.example/download/"),
            "{md}"
        );
        assert!(md.contains(&format!("session_id: `{s}`")), "{md}");
    }

    #[test]
    fn artifact_delivery_holds_the_clients_invariants() {
        assert_eq!(artifact_delivery(Delivery::default()), None);
        assert_eq!(
            artifact_delivery(Delivery {
                attempted: 3,
                failed: 0
            }),
            None
        );
        let partial = artifact_delivery(Delivery {
            attempted: 3,
            failed: 2,
        })
        .expect("partial");
        assert_eq!(
            partial,
            json!({"code": "artifact_delivery_failed", "status": "partial",
                   "attempted": 3, "delivered": 1, "failed": 2})
        );
        let failed = artifact_delivery(Delivery {
            attempted: 1,
            failed: 1,
        })
        .expect("failed");
        assert_eq!(failed["status"], "failed");
        assert_eq!(failed["delivered"], 0);
    }

    #[test]
    fn the_answer_names_deleted_inputs_only_when_there_are_some() {
        let mut output = crate::core::ExecOutput {
            session_id: "S".repeat(21),
            stdout: String::new(),
            stderr: String::new(),
            files: vec![],
            runtime_status: sandbox_runner::RuntimeStatus::New,
            exit_code: Some(0),
            duration_ms: 1,
            limits: vec![],
            compile_cached: None,
            deleted_files: vec![],
            delivery: Delivery::default(),
        };
        let quiet = output_json(&output);
        assert!(quiet.get("deleted_files").is_none(), "{quiet}");
        assert!(quiet.get("artifact_delivery").is_none(), "{quiet}");
        output.deleted_files = vec!["data/in.csv".into()];
        assert_eq!(
            output_json(&output)["deleted_files"],
            json!(["data/in.csv"])
        );
    }
}
