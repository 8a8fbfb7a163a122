//! E2B's protocol: a sandbox created and its first `run_code`, and warm `run_code`s,
//! beside codebroker's own `/exec` in the same run.

use crate::table::{p50, Row};
use crate::{timed, Bench, Scale};
use serde_json::{json, Value};

/// A created sandbox's id and interpreter token.
struct Sandbox {
    id: String,
    token: String,
}

async fn create(bench: &Bench) -> Sandbox {
    let v: Value = bench
        .client
        .post(bench.url("/e2b/v2/sandboxes"))
        .json(&json!({"templateID": "code-interpreter-v1"}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    Sandbox {
        id: v["sandboxID"].as_str().expect("id").to_string(),
        token: v["trafficAccessToken"].as_str().expect("token").to_string(),
    }
}

/// One `run_code` as the SDK sends it, read to its end; its stdout.
async fn run_code(bench: &Bench, sandbox: &Sandbox, code: &str) -> String {
    let text = bench
        .client
        .post(bench.url("/e2b/sandbox/execute"))
        .header("e2b-sandbox-id", &sandbox.id)
        .header("e2b-sandbox-port", "49999")
        .header("e2b-traffic-access-token", &sandbox.token)
        .json(&json!({"code": code, "language": "python"}))
        .send()
        .await
        .expect("execute")
        .text()
        .await
        .expect("body");
    assert!(
        text.ends_with("{\"type\":\"end_of_execution\"}\n"),
        "{text}"
    );
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["type"] == "stdout")
        .filter_map(|l| l["text"].as_str().map(str::to_string))
        .collect()
}

async fn kill(bench: &Bench, sandbox: &Sandbox) {
    let _ = bench
        .client
        .delete(bench.url(&format!("/e2b/sandboxes/{}", sandbox.id)))
        .send()
        .await;
}

/// Create to first result with the pool warm; warm `run_code` against warm `/exec`.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let bench = Bench::start("e2b", data, |c| c.pool.pool_size = 2).await;
    let mut first = Vec::new();
    for _ in 0..scale.pick(20, 4) {
        bench.wait_pool(1).await;
        let (took, (sandbox, out)) = timed(async {
            let sandbox = create(&bench).await;
            let out = run_code(&bench, &sandbox, "print(1)").await;
            (sandbox, out)
        })
        .await;
        assert_eq!(out, "1\n");
        first.push(took);
        kill(&bench, &sandbox).await;
    }

    let sandbox = create(&bench).await;
    let session_exec = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
    let session = session_exec["session_id"]
        .as_str()
        .expect("session")
        .to_string();
    for _ in 0..20 {
        run_code(&bench, &sandbox, "print(1)").await;
        bench
            .exec(json!({"lang": "py", "code": "print(1)", "session_id": session}))
            .await;
    }
    let (mut warm, mut exec) = (Vec::new(), Vec::new());
    // Interleaved, so both see the same host.
    for _ in 0..scale.pick(300, 30) {
        let (took, out) = timed(run_code(&bench, &sandbox, "print(1)")).await;
        assert_eq!(out, "1\n");
        warm.push(took);
        let (took, r) =
            timed(bench.exec(json!({"lang": "py", "code": "print(1)", "session_id": session})))
                .await;
        assert_eq!(r["stdout"], "1\n");
        exec.push(took);
    }
    kill(&bench, &sandbox).await;
    bench.stop().await;
    let exec50 = p50(&exec);
    rows.push(
        Row::timed(
            "E2B create to first result, pool warm",
            first,
            "p50<=150",
            "",
        )
        .on_idle_cpu(),
    );
    rows.push(Row::timed(
        "E2B warm run_code print(1)",
        warm,
        "p50<=5",
        &format!("/exec in the same run: p50 {exec50:.1}"),
    ));
}
