//! What the answer says about files beyond `files`: `deleted_files` (inputs the code
//! removed) and `artifact_delivery` (generated files that were not kept), on `/exec`,
//! `/exec/stream` and `/exec/programmatic` (docs/API.md, "POST /exec").

mod common;

use codebroker::config::{Config, FileTransfer};
use common::{session, stderr, stdout, TestBroker};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

const MIB: u64 = 1024 * 1024;

/// Uploads one file (with extra form fields) and returns its ref as the new contract
/// sends it, under `name`.
async fn upload(
    broker: &TestBroker,
    file: &str,
    bytes: &[u8],
    fields: &[(&str, &str)],
    name: &str,
) -> Value {
    let mut form = Form::new().part(
        "file",
        Part::bytes(bytes.to_vec()).file_name(file.to_string()),
    );
    for (k, v) in fields {
        form = form.text(k.to_string(), v.to_string());
    }
    let resp = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(resp.status(), 200);
    let up: Value = resp.json().await.expect("json");
    json!({ "id": up["files"][0]["fileId"], "storage_session_id": up["storage_session_id"], "name": name })
}

async fn exec_ok(broker: &TestBroker, body: Value) -> Value {
    let (status, resp) = broker.exec(body).await;
    assert_eq!(status, 200, "{resp}");
    resp
}

/// Checks the answer's `artifact_delivery` against its `files`, as `@librechat/agents`
/// does before it believes one, and returns `(status, attempted, delivered, failed)`.
fn delivery(resp: &Value) -> (String, u64, u64, u64) {
    let d = &resp["artifact_delivery"];
    assert_eq!(d["code"], "artifact_delivery_failed", "{resp}");
    let n = |k: &str| d[k].as_u64().unwrap_or_else(|| panic!("{k} in {resp}"));
    let (attempted, delivered, failed) = (n("attempted"), n("delivered"), n("failed"));
    assert_eq!(attempted, delivered + failed, "{resp}");
    assert!(failed >= 1, "{resp}");
    assert_eq!(
        delivered,
        resp["files"].as_array().expect("files").len() as u64,
        "{resp}"
    );
    let status = d["status"].as_str().expect("status").to_string();
    assert_eq!(status == "failed", delivered == 0, "{resp}");
    (status, attempted, delivered, failed)
}

#[tokio::test]
async fn an_input_the_code_removes_is_reported_by_the_name_its_ref_carried() {
    let broker = TestBroker::start("deleted").await;
    let input = upload(&broker, "in.csv", b"a,b\n1,2\n", &[], "data/in.csv").await;
    let keep = upload(&broker, "keep.txt", b"keep\n", &[], "keep.txt").await;
    let resp = exec_ok(
        &broker,
        json!({ "lang": "py", "files": [input, keep],
                "code": "import os\nprint(open('data/in.csv').read().strip())\nos.remove('data/in.csv')" }),
    )
    .await;
    assert_eq!(stdout(&resp), "a,b\n1,2\n", "{resp}");
    assert_eq!(resp["deleted_files"], json!(["data/in.csv"]), "{resp}");
    assert!(resp.get("artifact_delivery").is_none(), "{resp}");
    let s = session(&resp);

    // Not an input of this call: nothing to report; the file is gone from the listing too.
    let next = broker.run("bash", "ls -R", Some(&s)).await;
    assert!(!stdout(&next).contains("in.csv"), "{next}");
    assert!(next.get("deleted_files").is_none(), "{next}");
    let listed: Value = broker
        .get(&format!("/files/{s}?detail=full"))
        .await
        .json()
        .await
        .expect("list");
    let names: Vec<&str> = listed
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with("in.csv")), "{listed}");

    // A client that sends the ref again gets the file placed again.
    let again = exec_ok(
        &broker,
        json!({ "lang": "bash", "session_id": s, "files": [input], "code": "cat data/in.csv" }),
    )
    .await;
    assert_eq!(stdout(&again), "a,b\n1,2\n", "{again}");
    assert!(again.get("deleted_files").is_none(), "{again}");

    // Removed and written anew: a changed file, not a deleted one.
    let rewritten = exec_ok(
        &broker,
        json!({ "lang": "bash", "session_id": s, "files": [input],
                "code": "rm data/in.csv; echo new > data/in.csv" }),
    )
    .await;
    assert!(rewritten.get("deleted_files").is_none(), "{rewritten}");
    let names: Vec<&str> = rewritten["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(names, ["data/in.csv"], "{rewritten}");

    // Moved away: the input is deleted, the new name is a generated file.
    let moved = exec_ok(
        &broker,
        json!({ "lang": "bash", "session_id": s, "files": [keep], "code": "mv keep.txt kept.txt" }),
    )
    .await;
    assert_eq!(moved["deleted_files"], json!(["keep.txt"]), "{moved}");
    assert_eq!(moved["files"][0]["name"], "kept.txt", "{moved}");
}

/// A read-only input (`kind=skill`) the code removes: never reported deleted, and still
/// there for the next exec, with its content.
async fn read_only_input_stays(broker: &TestBroker) -> Value {
    let skill = upload(
        broker,
        "SKILL.md",
        b"# demo skill\n",
        &[("kind", "skill"), ("id", "skill_1"), ("version", "1")],
        "skills/demo/SKILL.md",
    )
    .await;
    let resp = exec_ok(
        broker,
        json!({ "lang": "bash", "files": [skill], "code": "rm -f skills/demo/SKILL.md; echo tried" }),
    )
    .await;
    assert_eq!(stdout(&resp), "tried\n", "{resp}");
    assert!(resp.get("deleted_files").is_none(), "{resp}");
    assert_eq!(resp["files"], json!([]), "{resp}");
    let s = session(&resp);
    let next = broker
        .run("bash", "cat skills/demo/SKILL.md", Some(&s))
        .await;
    assert_eq!(stdout(&next), "# demo skill\n", "{next}");
    assert!(next.get("deleted_files").is_none(), "{next}");
    resp
}

#[tokio::test]
async fn a_read_only_input_the_code_tries_to_remove_is_not_reported_deleted() {
    // The broker's uid is not the sandbox's: the sticky workspace keeps the file.
    let broker = TestBroker::start("deleted-ro").await;
    let resp = read_only_input_stays(&broker).await;
    assert!(!stderr(&resp).contains("put back"), "{resp}");
}

#[tokio::test]
async fn a_read_only_input_removed_through_the_runner_is_put_back() {
    // Files move through the runner, as the sandbox's uid: the code can remove it, and the
    // broker puts it back.
    let broker = TestBroker::start_with("deleted-ro-runner", |c| {
        c.sandbox.file_transfer = FileTransfer::Runner
    })
    .await;
    let resp = read_only_input_stays(&broker).await;
    assert!(
        stderr(&resp).contains("skills/demo/SKILL.md is a read-only upload; it was put back"),
        "{resp}"
    );
}

/// Four files an exec may report, of at most 1 MiB, in 3 MiB per session.
fn caps(c: &mut Config) {
    c.exec_limits.max_output_files = 4;
    c.exec_limits.max_output_file_mb = 1;
    c.caps.session_storage = 3 * MIB;
}

#[tokio::test]
async fn files_not_kept_are_counted_in_artifact_delivery() {
    let broker = TestBroker::start_with("delivery", caps).await;

    // Over the file cap: 6 written, 4 kept.
    let resp = broker
        .run(
            "bash",
            "for i in 1 2 3 4 5 6; do echo $i > f$i.txt; done",
            None,
        )
        .await;
    assert_eq!(delivery(&resp), ("partial".into(), 6, 4, 2));
    assert!(stderr(&resp).contains("left out"), "{resp}");
    let s = session(&resp);

    // The two left out are new to the next harvest: kept now, nothing failed.
    let next = broker.run("bash", "true", Some(&s)).await;
    assert_eq!(next["files"].as_array().expect("files").len(), 2, "{next}");
    assert!(next.get("artifact_delivery").is_none(), "{next}");

    // Over the size cap, alone: none kept.
    let big = broker
        .run("bash", "head -c 1100000 /dev/zero > big.bin", Some(&s))
        .await;
    assert_eq!(delivery(&big), ("failed".into(), 1, 0, 1));
    assert!(stderr(&big).contains("big.bin"), "{big}");
    // Unchanged since it was said: neither noted nor counted again.
    let quiet = broker.run("bash", "echo ok > ok.txt", Some(&s)).await;
    assert!(quiet.get("artifact_delivery").is_none(), "{quiet}");
    assert_eq!(quiet["files"][0]["name"], "ok.txt", "{quiet}");
}

#[tokio::test]
async fn files_over_the_storage_budget_are_counted_in_artifact_delivery() {
    let broker = TestBroker::start_with("delivery-budget", caps).await;
    // Four files of 900 kB: three fit in 3 MiB, the fourth does not.
    let resp = broker
        .run(
            "bash",
            "for i in 1 2 3 4; do head -c 900000 /dev/urandom > part$i.bin; done",
            None,
        )
        .await;
    assert_eq!(delivery(&resp), ("partial".into(), 4, 3, 1));
    assert!(stderr(&resp).contains("not kept: part4.bin"), "{resp}");
    let s = session(&resp);

    // Full: a new file does not fit either, and the exec says none was kept.
    let full = broker
        .run("bash", "head -c 900000 /dev/urandom > more.bin", Some(&s))
        .await;
    assert_eq!(delivery(&full), ("failed".into(), 1, 0, 1));

    // The next call still works, and a small file fits once a big one is gone.
    let freed = exec_ok(
        &broker,
        json!({ "lang": "bash", "session_id": s, "files": [
                  { "id": resp["files"][0]["id"], "storage_session_id": s, "name": "part1.bin" }],
                "code": "rm part1.bin more.bin part4.bin; echo small > small.txt" }),
    )
    .await;
    assert_eq!(freed["deleted_files"], json!(["part1.bin"]), "{freed}");
    let names: Vec<&str> = freed["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(names, ["small.txt"], "{freed}");
    assert!(freed.get("artifact_delivery").is_none(), "{freed}");
}

#[tokio::test]
async fn the_stream_and_programmatic_answers_carry_both_fields() {
    let broker = TestBroker::start_with("delivery-routes", caps).await;
    let input = upload(&broker, "in.txt", b"x\n", &[], "in.txt").await;
    let code = "rm in.txt; head -c 1100000 /dev/zero > big.bin; echo ok > ok.txt";

    let text = broker
        .client
        .post(broker.url("/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({ "lang": "bash", "code": code, "files": [input] }))
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("body");
    let result = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["event"] == "result")
        .unwrap_or_else(|| panic!("no result in {text}"))["data"]
        .clone();
    assert_eq!(result["deleted_files"], json!(["in.txt"]), "{result}");
    assert_eq!(delivery(&result), ("partial".into(), 2, 1, 1));

    let input = upload(&broker, "in.txt", b"x\n", &[], "in.txt").await;
    let resp = broker
        .client
        .post(broker.url("/exec/programmatic"))
        .json(&json!({ "lang": "bash", "code": code, "tools": [], "files": [input] }))
        .send()
        .await
        .expect("programmatic");
    assert_eq!(resp.status(), 200);
    let done: Value = resp.json().await.expect("json");
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["deleted_files"], json!(["in.txt"]), "{done}");
    assert_eq!(delivery(&done), ("partial".into(), 2, 1, 1));
}
