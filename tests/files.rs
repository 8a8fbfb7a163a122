//! Files written in /mnt/data are listed and download byte for byte.

mod common;

use common::{session, TestBroker};

#[tokio::test]
async fn written_files_are_listed_and_download_exactly() {
    let broker = TestBroker::start("files").await;
    let code = r#"
import os
with open('/mnt/data/abs.bin', 'wb') as f:
    f.write(bytes(range(256)) * 3)
with open('rel.txt', 'w') as f:
    f.write('relative path\n')
os.makedirs('charts', exist_ok=True)
with open('charts/a.png', 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\nfake')
os.makedirs('__pycache__', exist_ok=True)
open('__pycache__/skip.pyc', 'w').write('x')
open('.hidden', 'w').write('x')
"#;
    let resp = broker.run("py", code, None).await;
    let s = session(&resp);
    let files = resp["files"].as_array().expect("files").clone();
    let mut names: Vec<&str> = files.iter().filter_map(|f| f["name"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["abs.bin", "charts/a.png", "rel.txt"], "{resp}");
    for f in &files {
        let id = f["id"].as_str().expect("id");
        assert_eq!(id.len(), 21);
        assert_eq!(
            f["path"],
            format!("/mnt/data/{}", f["name"].as_str().unwrap_or(""))
        );
        let dl = broker.get(&format!("/download/{s}/{id}")).await;
        assert_eq!(dl.status(), 200);
        let cd = dl.headers()["content-disposition"]
            .to_str()
            .unwrap_or("")
            .to_string();
        assert!(cd.starts_with("attachment;"), "{cd}");
        let body = dl.bytes().await.expect("bytes");
        let want: Vec<u8> = match f["name"].as_str() {
            Some("abs.bin") => (0..=255u8).cycle().take(768).collect(),
            Some("rel.txt") => b"relative path\n".to_vec(),
            _ => b"\x89PNG\r\n\x1a\nfake".to_vec(),
        };
        assert_eq!(body.to_vec(), want);
    }

    // Unchanged files are not reported again; a changed one gets a new id.
    let again = broker.run("bash", "echo changed > rel.txt", Some(&s)).await;
    let files2 = again["files"].as_array().expect("files");
    assert_eq!(files2.len(), 1, "{again}");
    assert_eq!(files2[0]["name"], "rel.txt");
    let old = files.iter().find(|f| f["name"] == "rel.txt").expect("rel");
    assert_ne!(files2[0]["id"], old["id"]);
}

#[tokio::test]
async fn download_ids_are_checked() {
    let broker = TestBroker::start("dlids").await;
    let resp = broker.run("bash", "echo hi > a.txt", None).await;
    let s = session(&resp);
    let bad = broker.get(&format!("/download/{s}/..%2F..%2Fetc")).await;
    assert_eq!(bad.status(), 400);
    let unknown = broker
        .get(&format!("/download/{s}/{}", "A".repeat(21)))
        .await;
    assert_eq!(unknown.status(), 404);
    let unknown_session = broker
        .get(&format!("/download/{}/{}", "B".repeat(21), "A".repeat(21)))
        .await;
    assert_eq!(unknown_session.status(), 404);
    let body: serde_json::Value = unknown_session.json().await.expect("json");
    assert_eq!(body["error"], "not_found");
    // A symlink planted by the sandbox is never followed by the broker.
    let link = broker
        .run("bash", "ln -s /etc/passwd link.txt; ln -s / root", Some(&s))
        .await;
    assert_eq!(link["files"], serde_json::json!([]), "{link}");
}

#[tokio::test]
async fn planted_links_fifos_and_sockets_never_reach_the_host_side() {
    let broker = TestBroker::start("planted").await;
    let code = r#"
import os, socket
os.symlink('/etc/shadow', 'shadow.txt')
os.symlink('/', 'root')
os.makedirs('d', exist_ok=True)
os.symlink('/etc', 'd/etc')
os.mkfifo('pipe.csv')
s = socket.socket(socket.AF_UNIX); s.bind('sock')
open('real.txt', 'w').write('real')
os.link('real.txt', 'hard.txt')
"#;
    let started = std::time::Instant::now();
    let resp = broker.run("py", code, None).await;
    assert!(
        started.elapsed().as_secs() < 10,
        "the harvest must not hang on a FIFO"
    );
    let mut names: Vec<&str> = resp["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    names.sort();
    assert_eq!(names, ["hard.txt", "real.txt"], "{resp}");
    // Swap a reported file for a symlink: its id still serves the harvested bytes.
    let s = session(&resp);
    let real = resp["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "real.txt"))
        .and_then(|f| f["id"].as_str())
        .expect("real id")
        .to_string();
    broker
        .run(
            "bash",
            "rm real.txt && ln -s /etc/passwd real.txt",
            Some(&s),
        )
        .await;
    let body = broker
        .get(&format!("/download/{s}/{real}"))
        .await
        .text()
        .await
        .expect("text");
    assert_eq!(body, "real");
}
