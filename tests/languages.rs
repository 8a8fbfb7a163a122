//! Hello world in each of the 13 languages, compile errors, and arguments.

mod common;

use common::{stderr, stdout, TestBroker};
use sandbox_runner::language::LANGUAGES;
use serde_json::json;

#[tokio::test]
async fn hello_world_in_every_language() {
    let broker = TestBroker::start("langs").await;
    let mut session: Option<String> = None;
    for spec in LANGUAGES {
        let (lang, code) = (spec.name, spec.hello);
        let resp = broker.run(lang, code, session.as_deref()).await;
        assert_eq!(stdout(&resp).trim(), spec.hello_line(), "{lang}: {resp}");
        assert_eq!(resp["exit_code"], 0, "{lang}: {resp}");
        assert_eq!(resp["limits"], json!([]), "{lang}: {resp}");
        session = Some(common::session(&resp));
    }
}

#[tokio::test]
async fn compile_errors_show_in_stderr() {
    let broker = TestBroker::start("compile").await;
    let c = broker
        .run("c", "int main(void) { return undefined_name; }", None)
        .await;
    assert!(stderr(&c).contains("undefined_name"), "{c}");
    assert_ne!(c["exit_code"], 0, "{c}");

    let rs = broker
        .run("rs", "fn main() { let x: i32 = \"no\"; }", None)
        .await;
    assert!(stderr(&rs).contains("mismatched types"), "{rs}");
    assert_ne!(rs["exit_code"], 0, "{rs}");
}

#[tokio::test]
async fn args_reach_every_kind_of_program() {
    let broker = TestBroker::start("args").await;
    let cases = [
        ("py", "import sys; print(sys.argv[1:])", "['a b', 'c']"),
        ("bash", "echo \"$1|$2\"", "a b|c"),
        (
            "js",
            "console.log(process.argv.slice(2).join('|'))",
            "a b|c",
        ),
        (
            "c",
            "#include <stdio.h>\nint main(int n, char **v) { printf(\"%s|%s\\n\", v[1], v[2]); }",
            "a b|c",
        ),
    ];
    for (lang, code, want) in cases {
        let (status, resp) = broker
            .exec(json!({ "lang": lang, "code": code, "args": ["a b", "c"] }))
            .await;
        assert_eq!(status, 200);
        assert_eq!(stdout(&resp).trim(), want, "{lang}: {resp}");
    }
    // A single string is split at white space.
    let (_, resp) = broker
        .exec(json!({ "lang": "bash", "code": "echo $#", "args": "x y z" }))
        .await;
    assert_eq!(stdout(&resp).trim(), "3", "{resp}");
}

/// The compile-cache counters of `/metrics`: (hits, misses).
async fn compile_cache_counts(broker: &TestBroker) -> (u64, u64) {
    let text = broker.get("/metrics").await.text().await.expect("metrics");
    let count = |outcome: &str| {
        let prefix = format!("codebroker_compile_cache_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (count("hit"), count("miss"))
}

#[tokio::test]
async fn a_rerun_program_comes_from_the_compile_cache() {
    let broker = TestBroker::start("ccache").await;
    let code =
        "#include <stdio.h>\nint main(int c, char **v) { printf(\"args %d\\n\", c); return 0; }";
    let first = broker.run("c", code, None).await;
    let s = common::session(&first);
    assert_eq!(stdout(&first), "args 1\n", "{first}");
    assert_eq!(compile_cache_counts(&broker).await, (0, 1));
    let second = broker.run("c", code, Some(&s)).await;
    assert_eq!(second["stdout"], first["stdout"]);
    assert_eq!(second["exit_code"], 0);
    assert_eq!(compile_cache_counts(&broker).await, (1, 1));
    // Another program is compiled; the cache lives outside /mnt/data, so no file shows.
    let other = broker
        .run("c", &code.replace("args", "argc"), Some(&s))
        .await;
    assert_eq!(stdout(&other), "argc 1\n");
    assert_eq!(compile_cache_counts(&broker).await, (1, 2));
    assert_eq!(other["files"], json!([]), "{other}");
    let ls = broker.run("bash", "ls -A /mnt/data", Some(&s)).await;
    assert_eq!(stdout(&ls), "");
    // Java too: its class files are the cached output.
    let java =
        "public class Hi { public static void main(String[] a) { System.out.println(\"hi\"); } }";
    for expected in [(1, 3), (2, 3)] {
        let r = broker.run("java", java, Some(&s)).await;
        assert_eq!(stdout(&r), "hi\n", "{r}");
        assert_eq!(compile_cache_counts(&broker).await, expected);
    }
}
