//! Files through the runner (`CODEBROKER_FILE_TRANSFER=runner`): what sandboxed code does
//! to `/mnt/data` comes out as it does through the host directory, and a sandbox that
//! plants links, odd names, floods of files or files over the limits gets nothing more.

mod common;

use codebroker::config::{Config, FileTransfer};
use common::{session, stderr, stdout, TestBroker};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

async fn runner_broker(tag: &str, adjust: impl FnOnce(&mut Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.sandbox.file_transfer = FileTransfer::Runner;
        adjust(c);
    })
    .await
}

/// The reported files of an exec as `(name, size, sha256 of the download)`, by name.
async fn harvested(broker: &TestBroker, resp: &Value) -> Vec<(String, u64, String)> {
    let s = session(resp);
    let mut out = Vec::new();
    for f in resp["files"].as_array().expect("files") {
        let id = f["id"].as_str().expect("id");
        let dl = broker.get(&format!("/download/{s}/{id}")).await;
        assert_eq!(dl.status(), 200);
        let body = dl.bytes().await.expect("bytes");
        out.push((
            f["name"].as_str().expect("name").to_string(),
            body.len() as u64,
            hex::encode(Sha256::digest(&body)),
        ));
    }
    out.sort();
    out
}

/// Code that writes what a harvest must sort out: plain files, nested ones, hidden and
/// cached ones, links out and in, a FIFO, odd names, one file over the size limit.
const MIXED: &str = r#"
mkdir -p charts/deep/er __pycache__ .cache node_modules
printf 'plain\n' > a.txt
head -c 300000 /dev/urandom > charts/deep/er/blob.bin
echo x > __pycache__/m.pyc; echo x > .hidden; echo x > .cache/c; echo x > node_modules/n.js
ln -s /etc/passwd passwd
ln -s /etc etc
ln -s a.txt inner-link
mkfifo pipe
echo dots > 'a..b'
echo dots > '..c'
printf 'nl\n' > "$(printf 'new\nline')"
head -c 3000000 /dev/zero > big.bin
"#;

#[tokio::test]
async fn the_runner_path_harvests_what_the_host_path_does() {
    let limit = |c: &mut Config| c.exec_limits.max_output_file_mb = 2;
    let host = TestBroker::start_with("xfer-host", limit).await;
    let runner = runner_broker("xfer-runner", limit).await;
    let a = host.run("bash", MIXED, None).await;
    let b = runner.run("bash", MIXED, None).await;
    let (files_a, files_b) = (harvested(&host, &a).await, harvested(&runner, &b).await);
    let names: Vec<&str> = files_b.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(
        names,
        ["a..b", "a.txt", "charts/deep/er/blob.bin", "new\nline"],
        "{b}"
    );
    // Random bytes differ between the runs: compare what does not.
    let shape = |files: &[(String, u64, String)]| -> Vec<(String, u64)> {
        files.iter().map(|f| (f.0.clone(), f.1)).collect()
    };
    assert_eq!(shape(&files_a), shape(&files_b));
    assert_eq!(files_a[1], files_b[1], "a.txt");
    assert_eq!(stderr(&a), stderr(&b));
    assert!(stderr(&b).contains("big.bin"), "{b}");

    // Unchanged files are not reported again; a touched one neither; a changed one is.
    for (broker, resp) in [(&host, &a), (&runner, &b)] {
        let s = session(resp);
        let again = broker
            .run(
                "bash",
                "touch a.txt; echo more >> charts/deep/er/blob.bin",
                Some(&s),
            )
            .await;
        let names: Vec<String> = harvested(broker, &again)
            .await
            .into_iter()
            .map(|f| f.0)
            .collect();
        assert_eq!(names, ["charts/deep/er/blob.bin"], "{again}");
    }
}

#[tokio::test]
async fn links_out_of_the_workspace_are_never_read_or_written_through() {
    let broker = runner_broker("xfer-links", |_| {}).await;
    let resp = broker
        .run(
            "bash",
            "ln -s /etc/passwd passwd; ln -s /etc etc; mkdir d; ln -s /etc d/up",
            None,
        )
        .await;
    assert_eq!(resp["files"], json!([]), "{resp}");
    let s = session(&resp);
    // An upload at a link's name replaces the link; one below a linked directory fails.
    let form = Form::new()
        .text("session_id", s.clone())
        .part("file", Part::bytes(b"mine".to_vec()).file_name("passwd"));
    let up = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(up.status(), 200);
    let check = broker
        .run(
            "bash",
            "cat passwd; echo; test -L passwd && echo link; grep -c root /etc/passwd",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check), "mine\n1\n", "{check}");
}

#[tokio::test]
async fn floods_and_oversized_files_are_capped_as_on_the_host_path() {
    let caps = |c: &mut Config| {
        c.exec_limits.max_output_files = 5;
        c.exec_limits.max_output_file_mb = 1;
    };
    let code =
        "for i in $(seq 1 60); do echo $i > f$i.txt; done; head -c 2000000 /dev/zero > huge.bin";
    let host = TestBroker::start_with("xfer-flood-h", caps).await;
    let runner = runner_broker("xfer-flood-r", caps).await;
    let a = host.run("bash", code, None).await;
    let b = runner.run("bash", code, None).await;
    assert_eq!(b["files"].as_array().expect("files").len(), 5, "{b}");
    assert_eq!(stderr(&a), stderr(&b));
    assert!(stderr(&b).contains("left out"), "{b}");
    assert!(stderr(&b).contains("huge.bin"), "{b}");
}

#[tokio::test]
async fn uploads_before_any_sandbox_reach_the_first_one() {
    let broker = runner_broker("xfer-pending", |_| {}).await;
    let form = Form::new()
        .part(
            "file",
            Part::bytes(b"1,2\n".to_vec()).file_name("in/data.csv"),
        )
        .part("file", Part::bytes(b"gone".to_vec()).file_name("gone.txt"));
    let up: Value = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload")
        .json()
        .await
        .expect("json");
    let s = up["session_id"].as_str().expect("session").to_string();
    let gone = up["files"][1]["fileId"].as_str().expect("file id");
    let del = broker
        .client
        .delete(broker.url(&format!("/files/{s}/{gone}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(del.status(), 200);
    let resp = broker.run("bash", "cat in/data.csv; ls", Some(&s)).await;
    assert_eq!(stdout(&resp), "1,2\nin\n", "{resp}");
    // Placed inputs are not reported as generated.
    assert_eq!(resp["files"], json!([]), "{resp}");
}
