//! POST /exec/programmatic over plain HTTP: tool calls, batches, errors, timeouts, cancel.

mod common;

use common::TestBroker;
use serde_json::{json, Value};
use std::time::Duration;

fn tools() -> Value {
    json!([
        { "name": "add", "description": "Adds a and b.",
          "parameters": { "type": "object", "properties": { "a": {"type": "number"}, "b": {"type": "number"} }, "required": ["a", "b"] } },
        { "name": "mul", "description": "Multiplies a and b.",
          "parameters": { "type": "object", "properties": { "a": {"type": "number"}, "b": {"type": "number"} }, "required": ["a", "b"] } },
    ])
}

async fn post(broker: &TestBroker, body: Value, request_id: Option<&str>) -> (u16, Value) {
    let mut req = broker
        .client
        .post(broker.url("/v1/exec/programmatic"))
        .json(&body);
    if let Some(id) = request_id {
        req = req.header("X-LibreChat-Code-Request-ID", id);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// Plays the client: answers every call with `answer(name, input)` until the run ends.
async fn drive(
    broker: &TestBroker,
    first: Value,
    answer: impl Fn(&str, &Value) -> Value,
) -> (Value, Vec<Vec<Value>>) {
    let (status, mut resp) = post(broker, first, None).await;
    assert_eq!(status, 200, "{resp}");
    let mut batches = Vec::new();
    while resp["status"] == "tool_call_required" {
        let calls = resp["tool_calls"].as_array().expect("tool_calls").clone();
        let results: Vec<Value> = calls
            .iter()
            .map(|c| {
                json!({ "call_id": c["id"], "result": answer(c["name"].as_str().unwrap_or(""), &c["input"]), "is_error": false })
            })
            .collect();
        batches.push(calls);
        let (status, next) = post(
            broker,
            json!({ "continuation_token": resp["continuation_token"], "tool_results": results }),
            None,
        )
        .await;
        assert_eq!(status, 200, "{next}");
        resp = next;
    }
    (resp, batches)
}

fn arith(name: &str, input: &Value) -> Value {
    let (a, b) = (
        input["a"].as_f64().unwrap_or(0.0),
        input["b"].as_f64().unwrap_or(0.0),
    );
    match name {
        "add" => json!(a + b),
        "mul" => json!(a * b),
        _ => json!(null),
    }
}

#[tokio::test]
async fn sequential_and_parallel_python_calls() {
    let broker = TestBroker::start("ptc-py").await;
    let code = "a = await add(a=1, b=2)\nb = await mul(a=a, b=10)\nprint(int(b))";
    let (done, batches) = drive(&broker, json!({ "code": code, "tools": tools() }), arith).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["stdout"], "30\n");
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0][0]["name"], "add");
    assert_eq!(batches[0][0]["input"], json!({"a": 1, "b": 2}));

    let code = "import asyncio\nr = await asyncio.gather(add(a=1, b=2), mul(a=3, b=4))\nprint([int(x) for x in r])";
    let (done, batches) = drive(&broker, json!({ "code": code, "tools": tools() }), arith).await;
    assert_eq!(done["stdout"], "[3, 12]\n", "{done}");
    assert_eq!(
        batches.len(),
        1,
        "parallel calls come in one batch: {batches:?}"
    );
    assert_eq!(batches[0].len(), 2);
}

#[tokio::test]
async fn prints_around_calls_keep_their_place() {
    let broker = TestBroker::start("ptc-prints").await;
    // Buffered output is flushed before each call; the exec's stdout is whole and in order.
    let code = "import sys\nfor i in range(1000):\n    print(i)\nr = await add(a=1, b=2)\n\
                sys.stderr.write('between\\n')\nprint('after', int(r))";
    let (done, batches) = drive(&broker, json!({ "code": code, "tools": tools() }), arith).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(batches.len(), 1);
    let mut want: String = (0..1000).map(|i| format!("{i}\n")).collect();
    want.push_str("after 3\n");
    assert_eq!(done["stdout"], want.as_str(), "{done}");
    assert_eq!(done["stderr"], "between\n", "{done}");
}

#[tokio::test]
async fn twenty_round_trips() {
    let broker = TestBroker::start("ptc-20").await;
    let code = "t = 0\nfor i in range(20):\n    t = await add(a=t, b=1)\nprint(int(t))";
    let (done, batches) = drive(
        &broker,
        json!({ "code": code, "tools": tools(), "timeout": 60000 }),
        arith,
    )
    .await;
    assert_eq!(done["stdout"], "20\n", "{done}");
    assert_eq!(batches.len(), 20);
}

#[tokio::test]
async fn tool_errors_and_unknown_tools_fail_inside_the_code() {
    let broker = TestBroker::start("ptc-err").await;
    let code = "try:\n    await add(a=1, b=2)\nexcept Exception as e:\n    print('caught:', e)";
    let (status, first) = post(&broker, json!({ "code": code, "tools": tools() }), None).await;
    assert_eq!(status, 200);
    let call = &first["tool_calls"][0];
    let (_, done) = post(
        &broker,
        json!({ "continuation_token": first["continuation_token"], "tool_results": [
            { "call_id": call["id"], "result": null, "is_error": true, "error_message": "quota exhausted" }
        ] }),
        None,
    )
    .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert!(
        done["stdout"]
            .as_str()
            .unwrap_or("")
            .contains("caught: quota exhausted"),
        "{done}"
    );

    let (_, done) = post(
        &broker,
        json!({ "code": "await nope(x=1)", "tools": tools() }),
        None,
    )
    .await;
    assert_eq!(done["status"], "error", "{done}");
    assert!(
        done["stderr"].as_str().unwrap_or("").contains("nope"),
        "{done}"
    );
}

#[tokio::test]
async fn tokens_are_single_use_and_runs_time_out_and_cancel() {
    let broker = TestBroker::start("ptc-tokens").await;
    let (_, first) = post(
        &broker,
        json!({ "code": "print(await add(a=1, b=1))", "tools": tools(), "timeout": 2000 }),
        None,
    )
    .await;
    let token = first["continuation_token"].clone();
    // The client thinks longer than the run may take.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let results = json!([{ "call_id": first["tool_calls"][0]["id"], "result": 2 }]);
    let (status, late) = post(
        &broker,
        json!({ "continuation_token": token, "tool_results": results }),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(late["status"], "error", "{late}");
    assert_eq!(late["error"], "Time limit exceeded");
    let (status, _) = post(
        &broker,
        json!({ "continuation_token": token, "tool_results": [] }),
        None,
    )
    .await;
    assert_eq!(status, 409, "a used token");
    let (status, body) = post(
        &broker,
        json!({ "continuation_token": "x".repeat(21), "tool_results": [] }),
        None,
    )
    .await;
    assert_eq!(status, 404, "{body}");

    let (_, waiting) = post(
        &broker,
        json!({ "code": "print(await add(a=1, b=1))", "tools": tools() }),
        Some("req-1"),
    )
    .await;
    assert_eq!(waiting["status"], "tool_call_required");
    let cancel = broker
        .client
        .post(broker.url("/exec/programmatic/cancel"))
        .json(&json!({ "request_id": "req-1" }))
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancel.status(), 200);
    let (_, done) = post(
        &broker,
        json!({ "continuation_token": waiting["continuation_token"], "tool_results": [] }),
        None,
    )
    .await;
    assert_eq!(done["status"], "error", "{done}");
    // The session still works.
    let s = done["session_id"].as_str().expect("session").to_string();
    let next = broker.run("py", "print('ok')", Some(&s)).await;
    assert_eq!(next["stdout"], "ok\n");
}

#[tokio::test]
async fn bash_and_javascript_runs() {
    let broker = TestBroker::start("ptc-langs").await;
    let (done, batches) = drive(
        &broker,
        json!({ "lang": "bash", "code": "add '{\"a\": 2, \"b\": 3}'\necho '{\"a\": 4, \"b\": 5}' | mul", "tools": tools() }),
        arith,
    )
    .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["stdout"], "5.0\n20.0\n", "{done}");
    assert_eq!(batches.len(), 2);

    let (done, _) = drive(
        &broker,
        json!({ "lang": "js", "code": "const [x, y] = await Promise.all([add({a: 1, b: 2}), mul({a: 2, b: 5})]);\nconsole.log(x + y);", "tools": tools() }),
        arith,
    )
    .await;
    assert_eq!(done["stdout"], "13\n", "{done}");
}
