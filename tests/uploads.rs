//! Uploads, listings, input refs, versions, deletion and expiry, in both contract
//! generations (docs/API.md, "Files").

mod common;

use common::{session, stderr, stdout, TestBroker};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use std::time::Duration;

async fn upload(broker: &TestBroker, path: &str, form: Form) -> (u16, Value) {
    let resp = broker
        .client
        .post(broker.url(path))
        .multipart(form)
        .send()
        .await
        .expect("upload");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn file_part(name: &str, bytes: &[u8]) -> Part {
    Part::bytes(bytes.to_vec()).file_name(name.to_string())
}

const CSV: &[u8] = b"city,temp\nOslo,3\nRome,18\nLima,22\n";

#[tokio::test]
async fn classic_flow_upload_csv_pandas_plot_and_csv_back() {
    let broker = TestBroker::start("classic").await;
    let form = Form::new()
        .part("file", file_part("data.csv", CSV))
        .text("entity_id", "asst_1");
    let (status, up) = upload(&broker, "/v1/upload", form).await;
    assert_eq!(status, 200, "{up}");
    assert_eq!(up["message"], "success");
    let s = up["session_id"].as_str().expect("session_id").to_string();
    assert_eq!(up["storage_session_id"], s.as_str());
    let file_id = up["files"][0]["fileId"]
        .as_str()
        .expect("fileId")
        .to_string();
    assert_eq!(up["files"][0]["filename"], "data.csv");

    // LibreChat's tool sends no session_id, only the refs: the exec finds the session.
    let code = r#"
import pandas as pd, matplotlib.pyplot as plt
df = pd.read_csv('/mnt/data/data.csv')
df['temp_f'] = df.temp * 9 / 5 + 32
df.to_csv('/mnt/data/out.csv', index=False)
df.plot(x='city', y='temp', kind='bar')
plt.show()
print(df.temp.sum())
"#;
    let (status, resp) = broker
        .exec(json!({
            "lang": "py", "code": code,
            "files": [{ "id": file_id, "session_id": s, "name": "data.csv" }],
        }))
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(stdout(&resp).trim(), "43", "{resp}");
    // An agent's files (classic `entity_id`) are shared and read-only: the exec runs in a
    // session of the caller's own, and its outputs stay there.
    let x = session(&resp);
    assert_ne!(x, s, "the exec ran in the shared upload's session");
    let files = resp["files"].as_array().expect("files");
    let mut names: Vec<&str> = files.iter().filter_map(|f| f["name"].as_str()).collect();
    names.sort();
    assert_eq!(names.len(), 2, "{resp}");
    assert_eq!(names[0], "out.csv");
    assert!(names[1].ends_with(".png"), "{resp}");
    for f in files {
        let id = f["id"].as_str().expect("id");
        let dl = broker
            .get(&format!("/v1/download/{x}/{id}?extra=ignored"))
            .await;
        assert_eq!(dl.status(), 200);
        let bytes = dl.bytes().await.expect("bytes");
        if f["name"] == "out.csv" {
            assert!(bytes.starts_with(b"city,temp,temp_f\nOslo,3,37.4"));
        } else {
            assert!(bytes.starts_with(b"\x89PNG"));
        }
    }

    // Listing: summary and full. The exec's session has the input's copy and the outputs.
    let summary: Value = broker
        .get(&format!("/v1/files/{x}?detail=summary"))
        .await
        .json()
        .await
        .expect("json");
    let list = summary.as_array().expect("list");
    assert_eq!(list.len(), 3, "{summary}");
    for item in list {
        let name = item["name"].as_str().expect("name");
        assert!(name.starts_with(&format!("{x}/")), "{name}");
        assert_eq!(
            name,
            format!("{x}/{}", item["fileId"].as_str().expect("fileId"))
        );
        assert!(item["lastModified"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')));
    }
    let full: Value = broker
        .get(&format!("/files/{s}?detail=full&entity_id=asst_1"))
        .await
        .json()
        .await
        .expect("json");
    let csv = full
        .as_array()
        .and_then(|l| l.iter().find(|f| f["id"] == file_id.as_str()))
        .expect("uploaded file listed");
    assert_eq!(csv["metadata"]["original-filename"], "data.csv");
    assert_eq!(csv["name"], format!("{s}/{file_id}"));
    assert_eq!(csv["contentType"], "text/csv");
    assert_eq!(csv["size"], CSV.len());
    assert_eq!(csv["storage_session_id"], s.as_str());

    // The uploaded input was not reported as generated.
    assert!(files.iter().all(|f| f["name"] != "data.csv"));
    // The shared session holds the upload alone.
    let shared: Value = broker
        .get(&format!("/v1/files/{s}?detail=summary"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(shared.as_array().map(Vec::len), Some(1), "{shared}");

    // The next call with the same refs finds the caller's session again, variables too.
    let (status, again) = broker
        .exec(json!({
            "lang": "py", "code": "print(len(df))",
            "files": [{ "id": file_id, "session_id": s, "name": "data.csv" }],
        }))
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(session(&again), x, "{again}");
    assert_eq!(stdout(&again), "3\n", "{again}");
}

#[tokio::test]
async fn new_contract_refs_from_two_upload_sessions() {
    let broker = TestBroker::start("newrefs").await;
    let mut refs = Vec::new();
    for (name, body, kind) in [
        ("a.txt", &b"alpha"[..], "user"),
        ("skills/pptx/SKILL.md", &b"# skill"[..], "skill"),
    ] {
        let form = Form::new()
            .part("file", file_part(name, body))
            .text("kind", kind)
            .text("id", "res_1")
            .text("version", "3");
        let (status, up) = upload(&broker, "/upload", form).await;
        assert_eq!(status, 200, "{up}");
        assert_eq!(up["files"][0]["filename"], name);
        refs.push(json!({
            "id": up["files"][0]["fileId"],
            "resource_id": "res_1",
            "storage_session_id": up["storage_session_id"],
            "name": name,
            "kind": kind,
        }));
    }
    assert_ne!(refs[0]["storage_session_id"], refs[1]["storage_session_id"]);
    let (status, resp) = broker
        .exec(json!({
            "lang": "bash",
            "code": "cat a.txt; echo; cat skills/pptx/SKILL.md; echo; echo changed >> skills/pptx/SKILL.md 2>/dev/null || echo read-only",
            "files": refs,
        }))
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(stdout(&resp), "alpha\n# skill\nread-only\n", "{resp}");
    assert_eq!(
        resp["files"],
        json!([]),
        "inputs and skills are not generated files: {resp}"
    );

    // An unknown ref: the exec still runs and stderr names it.
    let (status, resp) = broker
        .exec(json!({
            "lang": "bash", "code": "echo ran",
            "files": [{ "id": "Z".repeat(21), "storage_session_id": "Y".repeat(21), "name": "gone.csv" }],
        }))
        .await;
    assert_eq!(status, 200);
    assert_eq!(stdout(&resp).trim(), "ran");
    assert!(stderr(&resp).contains("gone.csv"), "{resp}");
}

#[tokio::test]
async fn a_changed_file_gets_a_new_id_and_the_old_id_keeps_its_bytes() {
    let broker = TestBroker::start("versions").await;
    let first = broker.run("bash", "echo one > v.txt", None).await;
    let s = session(&first);
    let old = first["files"][0]["id"].as_str().expect("id").to_string();
    let second = broker.run("bash", "echo two > v.txt", Some(&s)).await;
    let new = second["files"][0]["id"].as_str().expect("id").to_string();
    assert_ne!(old, new);
    assert_eq!(second["files"][0]["modified_from"], old.as_str());
    let old_bytes = broker
        .get(&format!("/download/{s}/{old}"))
        .await
        .text()
        .await
        .expect("text");
    let new_bytes = broker
        .get(&format!("/download/{s}/{new}"))
        .await
        .text()
        .await
        .expect("text");
    assert_eq!((old_bytes.as_str(), new_bytes.as_str()), ("one\n", "two\n"));
    // The sandbox's later changes never reach a served version.
    broker.run("bash", "echo three > v.txt", Some(&s)).await;
    let again = broker
        .get(&format!("/download/{s}/{new}"))
        .await
        .text()
        .await
        .expect("text");
    assert_eq!(again, "two\n");
}

#[tokio::test]
async fn objects_and_deletion() {
    let broker = TestBroker::start("objects").await;
    // Uploaded for user x, who reads it back by name (a session made without a user is
    // invisible to named users).
    let form = Form::new()
        .text("user_id", "x")
        .part("file", file_part("données.csv", CSV));
    let (_, up) = upload(&broker, "/upload", form).await;
    let s = up["session_id"].as_str().expect("session").to_string();
    let f = up["files"][0]["fileId"].as_str().expect("file").to_string();
    let info: Value = broker
        .get(&format!("/sessions/{s}/objects/{f}?kind=user&id=x"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(info["name"], "données.csv");
    assert_eq!(info["size"], CSV.len());
    assert_eq!(info["contentType"], "text/csv");
    let dl = broker.get(&format!("/download/{s}/{f}")).await;
    assert_eq!(
        dl.headers()["content-disposition"].to_str().unwrap_or(""),
        "attachment; filename=\"donn_es.csv\"; filename*=UTF-8''donn%C3%A9es.csv"
    );
    let del = broker
        .client
        .delete(broker.url(&format!("/files/{s}/{f}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(del.status(), 200);
    let body: Value = del.json().await.expect("json");
    assert_eq!(body["message"], "File deleted successfully");
    assert_eq!(body["fileId"], f.as_str());
    assert_eq!(
        broker.get(&format!("/download/{s}/{f}")).await.status(),
        404
    );
    assert_eq!(
        broker
            .get(&format!("/sessions/{s}/objects/{f}"))
            .await
            .status(),
        404
    );
    let again = broker
        .client
        .delete(broker.url(&format!("/sessions/{s}/objects/{f}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(again.status(), 404);
    let unknown: Value = broker
        .get(&format!("/files/{}?detail=summary", "Q".repeat(21)))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(unknown, json!([]));
}

#[tokio::test]
async fn bad_uploads_are_refused_and_nothing_is_lost() {
    let broker = TestBroker::start_with("badupload", |c| c.caps.max_upload_mb = 1).await;
    for bad in ["../../etc/x", "/etc/passwd", "a/../../b"] {
        let (status, body) = upload(
            &broker,
            "/upload",
            Form::new().part("file", file_part(bad, b"x")),
        )
        .await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"], "bad_request");
    }
    let big = vec![7u8; 2 * 1024 * 1024];
    let (status, body) = upload(
        &broker,
        "/upload",
        Form::new().part("file", file_part("big.bin", &big)),
    )
    .await;
    assert_eq!(status, 413, "{body}");
    let (status, body) = upload(&broker, "/upload", Form::new().text("entity_id", "x")).await;
    assert_eq!(status, 400, "{body}");

    let form = Form::new()
        .part("file", file_part("ok.txt", b"fine"))
        .part("file", file_part("../evil", b"x"))
        .part("file", file_part("big.bin", &big));
    let (status, batch) = upload(&broker, "/upload/batch", form).await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["message"], "partial_success");
    assert_eq!(batch["succeeded"], 1);
    assert_eq!(batch["failed"], 2);
    let ok = &batch["files"][0];
    assert_eq!(ok["status"], "success");
    let s = batch["storage_session_id"].as_str().expect("session");
    let id = ok["fileId"].as_str().expect("id");
    let text = broker
        .get(&format!("/download/{s}/{id}"))
        .await
        .text()
        .await
        .expect("text");
    assert_eq!(text, "fine");
    let staging = std::fs::read_dir(broker.data.join("staging"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(staging, 0, "staged files are cleaned up");
}

#[tokio::test]
async fn expired_files_answer_404_and_free_their_space() {
    let broker = TestBroker::start_with("ttl", |c| {
        c.lifecycle.file_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let (_, up) = upload(
        &broker,
        "/upload",
        Form::new().part("file", file_part("t.txt", b"tmp")),
    )
    .await;
    let s = up["session_id"].as_str().expect("session").to_string();
    let f = up["files"][0]["fileId"].as_str().expect("file").to_string();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        broker.get(&format!("/download/{s}/{f}")).await.status(),
        404
    );
    let root = broker.data.join("sessions").join(&s);
    assert!(
        !root.join("files/t.txt").exists(),
        "the expired file's space is freed"
    );
}

#[tokio::test]
async fn a_ref_placed_under_another_name_is_still_an_input() {
    let broker = TestBroker::start("refname").await;
    let form = Form::new()
        .part("file", file_part("SKILL.md", b"# demo"))
        .text("kind", "skill")
        .text("id", "skill_1")
        .text("version", "3");
    let (_, up) = upload(&broker, "/upload", form).await;
    let (status, resp) = broker
        .exec(json!({
            "lang": "bash",
            "code": "cat skills/demo/SKILL.md > out.txt",
            "files": [{ "id": up["files"][0]["fileId"], "storage_session_id": up["storage_session_id"],
                        "name": "skills/demo/SKILL.md", "kind": "skill", "version": 3 }],
        }))
        .await;
    assert_eq!(status, 200);
    let names: Vec<&str> = resp["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(names, ["out.txt"], "{resp}");
}

#[tokio::test]
async fn a_runtime_session_hint_is_the_clients_own_key() {
    let broker = TestBroker::start("hint").await;
    let body = |code: &str, user: &str| json!({ "lang": "py", "code": code, "user_id": user, "runtime_session_hint": "conv-123" });
    let (_, first) = broker.exec(body("counter = 41", "u1")).await;
    let (_, second) = broker.exec(body("print(counter + 1)", "u1")).await;
    assert_eq!(stdout(&second).trim(), "42", "{second}");
    assert_eq!(session(&first), session(&second));
    let (_, other) = broker
        .exec(body("print('counter' in globals())", "u2"))
        .await;
    assert_eq!(
        stdout(&other).trim(),
        "False",
        "another user's hint is another session"
    );
}
