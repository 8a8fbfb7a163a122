//! Uploads and downloads, through each file path: `host` (the broker reads and writes the
//! sandbox's workspace directory, the default) and `runner` (the sandbox's runner places,
//! lists, hashes and streams the files over its channel). Each path gets its own broker.

use crate::table::{p50, Row};
use crate::{timed, Bench, Scale};
use codebroker::config::FileTransfer;
use serde_json::json;
use std::time::Duration;

/// Bytes of the large files, up and down.
const BIG: usize = 100 * 1024 * 1024;

/// Python that writes `BIG` random bytes to `path` (random so that hashing them is real
/// work, as with a real output).
fn write_big(path: &str) -> String {
    format!("import os\n_ = open('{path}', 'wb').write(os.urandom({BIG}))\n")
}

/// A broker for the file rows, moving files the way `transfer` says.
async fn start(data: &std::path::Path, transfer: FileTransfer) -> Bench {
    let tag = match transfer {
        FileTransfer::Host => "files",
        FileTransfer::Runner => "files-runner",
    };
    Bench::start(tag, data, |c| {
        c.caps.max_upload_mb = 128;
        c.pool.pool_size = 2;
        // A 100 MiB output is harvested, not left out as too large.
        c.exec_limits.max_output_file_mb = 128;
        c.sandbox.file_transfer = transfer;
    })
    .await
}

/// Uploads and downloads.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let host = start(data, FileTransfer::Host).await;
    let small_host = small_upload_then_exec(&host, scale).await;
    let (up, down) = big_up_and_down(&host, scale).await;
    let written_host = big_written_then_down(&host, scale, "host files").await;
    host.stop().await;

    let runner = start(data, FileTransfer::Runner).await;
    let small_runner = small_upload_then_exec(&runner, scale).await;
    let written_runner = big_written_then_down(&runner, scale, "runner files").await;
    runner.stop().await;

    rows.push(Row::timed(
        "1 MiB upload, then an exec reads it",
        small_host,
        "",
        "pool warm",
    ));
    rows.push(Row::timed(
        "1 MiB upload, then an exec reads it (runner files)",
        small_runner,
        "",
        "pool warm",
    ));
    rows.push(up);
    rows.push(down);
    rows.extend(written_host);
    rows.extend(written_runner);
}

/// Samples of a 1 MiB upload into a new session, then its first exec reading it.
async fn small_upload_then_exec(bench: &Bench, scale: Scale) -> Vec<Duration> {
    let mut small = Vec::new();
    let one_mib = vec![b'x'; 1024 * 1024];
    for _ in 0..scale.pick(10, 3) {
        // The upload's session has no sandbox; its first exec is handed a pooled one.
        bench.wait_pool(1).await;
        let (took, _) = timed(async {
            let up = bench.upload("in.bin", one_mib.clone()).await;
            let s = up["session_id"].as_str().expect("session").to_string();
            let id = up["files"][0]["id"].as_str().expect("id").to_string();
            let r = bench
                .exec(
                    json!({"lang": "py", "code": "print(len(open('/mnt/data/in.bin','rb').read()))",
                    "files": [{"id": id, "session_id": s, "name": "in.bin"}]}),
                )
                .await;
            assert_eq!(r["stdout"], "1048576\n", "{r}");
        })
        .await;
        small.push(took);
    }
    small
}

/// Streams the stored file `id` of session `s` down, and returns its length.
async fn download(bench: &Bench, s: &str, id: &str) -> usize {
    let resp = bench
        .client
        .get(format!("{}/download/{s}/{id}", bench.base))
        .send()
        .await
        .expect("download");
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut len = 0;
    while let Some(chunk) = futures::StreamExt::next(&mut body).await {
        len += chunk.expect("chunk").len();
    }
    len
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The rows of 100 MiB uploaded, then downloaded again.
async fn big_up_and_down(bench: &Bench, scale: Scale) -> (Row, Row) {
    let big: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
    let mut up_rates = Vec::new();
    let mut down_rates = Vec::new();
    let mut up_times = Vec::new();
    let mut down_times = Vec::new();
    for _ in 0..scale.pick(3, 1) {
        let (took, up) = timed(bench.upload("big.bin", big.clone())).await;
        up_times.push(took);
        up_rates.push(BIG as f64 / 1e6 / took.as_secs_f64());
        let s = up["session_id"].as_str().expect("session").to_string();
        let id = up["files"][0]["id"].as_str().expect("id").to_string();
        let (took, len) = timed(download(bench, &s, &id)).await;
        assert_eq!(len, BIG);
        down_times.push(took);
        down_rates.push(BIG as f64 / 1e6 / took.as_secs_f64());
    }
    let up = median(up_rates);
    let down = median(down_rates);
    (
        Row::timed(
            &format!("100 MiB upload: {up:.0} MB/s"),
            up_times,
            ">=200 MB/s",
            "",
        ),
        Row::timed(
            &format!("100 MiB download: {down:.0} MB/s"),
            down_times,
            ">=200 MB/s",
            "",
        ),
    )
}

/// The rows of 100 MiB coming down from a sandbox: an exec writes it to `/mnt/data`, the
/// harvest lists, hashes and stores it, then the client downloads it. Beside the exec
/// stands the same exec writing to `/tmp` (not harvested) in the same session, so the
/// difference is what the file path costs.
async fn big_written_then_down(bench: &Bench, scale: Scale, path: &str) -> Vec<Row> {
    let first = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
    let s = first["session_id"].as_str().expect("session").to_string();
    let mut alone = Vec::new();
    let mut written = Vec::new();
    let mut down_times = Vec::new();
    let mut down_rates = Vec::new();
    for _ in 0..scale.pick(3, 1) {
        let (took, r) = timed(
            bench.exec(json!({"lang": "py", "code": write_big("/tmp/big.bin"), "session_id": s})),
        )
        .await;
        assert_eq!(r["files"], json!([]), "{r}");
        alone.push(took);
        let (took, r) =
            timed(bench.exec(
                json!({"lang": "py", "code": write_big("/mnt/data/big.bin"), "session_id": s}),
            ))
            .await;
        written.push(took);
        let file = &r["files"][0];
        assert_eq!(file["name"], "big.bin", "{r}");
        let id = file["id"].as_str().expect("id").to_string();
        let (took, len) = timed(download(bench, &s, &id)).await;
        assert_eq!(len, BIG);
        down_times.push(took);
        down_rates.push(BIG as f64 / 1e6 / took.as_secs_f64());
    }
    let harvest_ms = (p50(&written) - p50(&alone)).max(0.0);
    let harvest_rate = BIG as f64 / 1e6 / (harvest_ms / 1000.0);
    let down = median(down_rates);
    vec![
        Row::timed(
            &format!("exec writes 100 MiB, harvested ({path})"),
            written,
            "",
            &format!(
                "same exec to /tmp p50 {:.0} ms; file path {harvest_ms:.0} ms ({harvest_rate:.0} MB/s)",
                p50(&alone)
            ),
        ),
        Row::timed(
            &format!("its 100 MiB download: {down:.0} MB/s ({path})"),
            down_times,
            ">=200 MB/s",
            "",
        ),
    ]
}
