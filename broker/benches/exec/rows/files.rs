//! Uploads and downloads.

use crate::table::Row;
use crate::{timed, Bench, Scale};
use serde_json::json;

/// Uploads and downloads.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let bench = Bench::start("files", data, |c| {
        c.caps.max_upload_mb = 128;
        c.pool.pool_size = 2;
    })
    .await;
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
    rows.push(Row::timed(
        "1 MiB upload, then an exec reads it",
        small,
        "",
        "pool warm",
    ));

    let size = 100 * 1024 * 1024;
    let big: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let mut up_rates = Vec::new();
    let mut down_rates = Vec::new();
    let mut up_times = Vec::new();
    let mut down_times = Vec::new();
    for _ in 0..scale.pick(3, 1) {
        let (took, up) = timed(bench.upload("big.bin", big.clone())).await;
        up_times.push(took);
        up_rates.push(size as f64 / 1e6 / took.as_secs_f64());
        let s = up["session_id"].as_str().expect("session").to_string();
        let id = up["files"][0]["id"].as_str().expect("id").to_string();
        let (took, len) = timed(async {
            let resp = bench
                .client
                .get(format!("{}/download/{s}/{id}", bench.base))
                .send()
                .await
                .expect("download");
            let mut body = resp.bytes_stream();
            let mut len = 0;
            while let Some(chunk) = futures::StreamExt::next(&mut body).await {
                len += chunk.expect("chunk").len();
            }
            len
        })
        .await;
        assert_eq!(len, size);
        down_times.push(took);
        down_rates.push(size as f64 / 1e6 / took.as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let up = median(&mut up_rates);
    let down = median(&mut down_rates);
    rows.push(Row::timed(
        &format!("100 MiB upload: {up:.0} MB/s"),
        up_times,
        ">=200 MB/s",
        "",
    ));
    rows.push(Row::timed(
        &format!("100 MiB download: {down:.0} MB/s"),
        down_times,
        ">=200 MB/s",
        "",
    ));
    bench.stop().await;
}
