//! The first exec of a new session: pool warm, no pool, `docker run`, `import pandas`.

use crate::table::{p50, Row};
use crate::{common, runtime_args, time_command, timed, Bench, Scale};
use serde_json::json;

/// The first exec of a new session: pool warm, no pool, `docker run`, `import pandas`.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let mut docker_run = Vec::new();
    let runtime = runtime_args();
    for _ in 0..scale.pick(10, 3) {
        let image = common::image();
        let mut args = vec!["docker", "run", "--rm", "--network", "none"];
        args.extend(runtime.iter().map(String::as_str));
        args.extend(["--entrypoint", "python3", &image, "-c", "print(1)"]);
        docker_run.push(time_command(&args));
    }
    let run50 = p50(&docker_run);

    let bench = Bench::start("pool", data, |c| c.pool.pool_size = 2).await;
    let mut pooled = Vec::new();
    let mut pandas = Vec::new();
    for i in 0..scale.pick(20, 4) {
        bench.wait_pool(1).await;
        let (took, r) = timed(bench.exec(json!({"lang": "py", "code": "print(1)"}))).await;
        pooled.push(took);
        if i % 2 == 0 {
            let s = r["session_id"].as_str().expect("session");
            let (took, r) = timed(bench.exec(json!({"lang": "py", "session_id": s,
                "code": "import pandas\nprint(pandas.__name__)"})))
            .await;
            assert_eq!(r["stdout"], "pandas\n", "{r}");
            pandas.push(took);
        }
    }
    bench.stop().await;
    rows.push(
        Row::timed(
            "new session, pool warm",
            pooled,
            "p50<=25",
            &format!("docker run: p50 {run50:.1}; issue: 1457"),
        )
        .on_idle_cpu(),
    );
    rows.push(Row::timed(
        "first import pandas in a session",
        pandas,
        "",
        "",
    ));

    let bench = Bench::start("cold", data, |_| {}).await;
    let mut cold = Vec::new();
    for _ in 0..scale.pick(10, 3) {
        let (took, _) = timed(bench.exec(json!({"lang": "py", "code": "print(1)"}))).await;
        cold.push(took);
    }
    bench.stop().await;
    rows.push(Row::timed(
        "new session, no pool",
        cold,
        "",
        &format!("docker run: p50 {run50:.1}"),
    ));
    rows.push(Row::timed(
        "docker run --rm python3 -c print(1)",
        docker_run,
        "",
        "issue: 361",
    ));
}
