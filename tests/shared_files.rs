//! Shared skill and agent files (docs/API.md, "Shared files"): uploaded with `kind=skill`,
//! `kind=agent` or classic `entity_id`, they belong to the tenant (a JWT's `tenant_id`, or
//! the API key), are read by every caller of it (freshness checks, downloads, input refs
//! placed read-only) and changed by none; another tenant sees nothing. Tried as an attacker
//! would: another tenant probing ids, users deleting or overwriting a skill's file, code
//! changing it in place, an exec aimed at the shared session itself.

mod common;

use codebroker::config::AuthMode;
use common::jwt::{claims, lc_ed_public_key, sign, ED_A};
use common::{session, stderr, stdout, TestBroker};
use jsonwebtoken::{Algorithm, EncodingKey};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};

const KEY: &str = "shared-key-1";
const OTHER_KEY: &str = "shared-key-2";
const SKILL: &str = "skill_6650aa11bb22cc33";
const SKILL_MD: &str = "# Demo skill\nRead data.txt.\n";
const DATA: &str = "pristine\n";

type Headers = Vec<(&'static str, String)>;

async fn broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.into(), OTHER_KEY.into()];
        c.access.jwt_public_keys = vec![lc_ed_public_key()];
    })
    .await
}

/// A LibreChat token for `sub` in `tenant` (`None`: without the claim).
fn jwt_in(sub: &str, tenant: Option<&str>) -> Headers {
    let mut c = claims(sub, 300, "codeapi", "librechat");
    match tenant {
        Some(t) => c["tenant_id"] = json!(t),
        None => {
            c.as_object_mut().expect("claims").remove("tenant_id");
        }
    }
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    let token = sign(Algorithm::EdDSA, &key, Some("lc-ed"), &c);
    vec![("authorization", format!("Bearer {token}"))]
}

/// An API-key caller (LibreChat's server) naming `user` (`None`: the key's whole scope).
fn keyed(key: &str, user: Option<&str>) -> Headers {
    let mut h = vec![("x-api-key", key.to_string())];
    if let Some(user) = user {
        h.push(("user-id", user.to_string()));
    }
    h
}

async fn send(mut request: reqwest::RequestBuilder, headers: &Headers) -> (u16, Value) {
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    common::answer(request.send().await.expect("request")).await
}

async fn get(b: &TestBroker, h: &Headers, path: &str) -> (u16, Value) {
    send(b.client.get(b.url(path)), h).await
}

async fn delete(b: &TestBroker, h: &Headers, path: &str) -> (u16, Value) {
    send(b.client.delete(b.url(path)), h).await
}

async fn exec(b: &TestBroker, h: &Headers, body: Value) -> (u16, Value) {
    send(b.client.post(b.url("/v1/exec")).json(&body), h).await
}

/// A multipart upload with the fields first, as LibreChat sends them.
async fn upload(
    b: &TestBroker,
    h: &Headers,
    path: &str,
    fields: &[(&str, &str)],
    files: &[(&str, &str)],
) -> Value {
    let mut form = Form::new();
    for (k, v) in fields {
        form = form.text(k.to_string(), v.to_string());
    }
    for (name, data) in files {
        form = form.part(
            "file",
            Part::bytes(data.as_bytes().to_vec()).file_name(name.to_string()),
        );
    }
    let (status, body) = send(b.client.post(b.url(path)).multipart(form), h).await;
    assert_eq!(status, 200, "upload: {body}");
    body
}

/// A skill as LibreChat primes it: one batch, `kind=skill`, its id and version,
/// `read_only=true`, nested names. Its session, and the ref of each file.
async fn upload_skill(b: &TestBroker, h: &Headers) -> (String, Vec<Value>) {
    let up = upload(
        b,
        h,
        "/v1/upload/batch",
        &[
            ("kind", "skill"),
            ("id", SKILL),
            ("version", "3"),
            ("read_only", "true"),
        ],
        &[
            ("skills/demo/SKILL.md", SKILL_MD),
            ("skills/demo/data.txt", DATA),
        ],
    )
    .await;
    assert_eq!(up["message"], "success", "{up}");
    let s = up["storage_session_id"]
        .as_str()
        .expect("session")
        .to_string();
    let refs = up["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            json!({ "id": f["fileId"], "resource_id": SKILL, "storage_session_id": s,
                    "name": f["filename"], "kind": "skill", "version": 3 })
        })
        .collect();
    (s, refs)
}

fn file_id<'a>(refs: &'a [Value], name: &str) -> &'a str {
    refs.iter()
        .find(|r| r["name"] == name)
        .and_then(|r| r["id"].as_str())
        .expect("ref")
}

/// The freshness checks LibreChat makes before it reuses an upload: the object's
/// metadata (`lastModified` under 23 h, `originalFilename`) and the session's summary
/// (`fileId`). `Some(answer)` when both find the file, `None` when both do not.
async fn fresh(b: &TestBroker, h: &Headers, s: &str, f: &str) -> Option<Value> {
    let (status, object) = get(
        b,
        h,
        &format!("/v1/sessions/{s}/objects/{f}?kind=skill&id={SKILL}&version=3"),
    )
    .await;
    let (list_status, list) = get(b, h, &format!("/v1/files/{s}?detail=summary")).await;
    assert_eq!(list_status, 200, "{list}");
    let listed = list
        .as_array()
        .expect("list")
        .iter()
        .any(|e| e["fileId"] == f && e["id"] == f);
    match status {
        200 => {
            assert!(listed, "object found but not listed: {list}");
            Some(object)
        }
        404 => {
            assert_eq!(list, json!([]), "object 404 but listed");
            None
        }
        other => panic!("freshness check: {other} {object}"),
    }
}

/// Code that reads the skill's data file, tries every way to change it in place, and
/// writes an output: what it could do, one line each.
const TAMPER: &str = r#"
import os
p = '/mnt/data/skills/demo/data.txt'
print('read', open(p).read().strip())
for name, attempt in [
    ('append', lambda: open(p, 'a').write('evil\n')),
    ('chmod', lambda: os.chmod(p, 0o666)),
    ('remove', lambda: os.remove(p)),
    ('rename', lambda: os.rename('/mnt/data/skills/demo', '/mnt/data/skills/moved')),
]:
    try:
        attempt()
        print(name, 'done')
    except OSError as e:
        print(name, 'refused', e.errno)
open('/mnt/data/out.txt', 'w').write('made by ' + os.environ.get('USER', 'me'))
print('now', open(p).read().strip() if os.path.exists(p) else 'gone')
"#;

/// Whether files move through the runner (`make test-runner-files`, and always on the
/// Kubernetes backend): read-only files are then the sandbox user's, mode 0444, and code
/// can `chmod` its own copy.
fn through_the_runner() -> bool {
    std::env::var("CODEBROKER_FILE_TRANSFER").as_deref() == Ok("runner")
        || common::docker::kubernetes()
}

#[tokio::test]
async fn a_skill_is_shared_in_its_tenant_read_only_and_unseen_by_other_tenants() {
    let b = broker("shared-jwt").await;
    let alice = jwt_in("alice", Some("t1"));
    let bob = jwt_in("bob", Some("t1"));
    let carol = jwt_in("carol", Some("t2"));
    let (s, refs) = upload_skill(&b, &alice).await;
    let data = file_id(&refs, "skills/demo/data.txt").to_string();

    // Everyone of the tenant passes the freshness checks, the uploader too.
    for (who, h) in [("alice", &alice), ("bob", &bob)] {
        let object = fresh(&b, h, &s, &data)
            .await
            .unwrap_or_else(|| panic!("{who}"));
        assert_eq!(object["originalFilename"], "skills/demo/data.txt", "{who}");
        assert_eq!(object["size"], DATA.len(), "{who}");
        assert_eq!(object["readOnly"], true, "{who}");
        let modified = object["lastModified"].as_str().expect("lastModified");
        assert!(modified.ends_with('Z'), "{modified}");
        let resp = b
            .client
            .get(b.url(&format!("/v1/download/{s}/{data}")))
            .header(h[0].0, &h[0].1)
            .send()
            .await
            .expect("download");
        assert_eq!(resp.status().as_u16(), 200, "{who}");
        assert_eq!(resp.text().await.expect("bytes"), DATA, "{who}");
    }
    // Another tenant: nothing, as if the ids did not exist.
    assert!(fresh(&b, &carol, &s, &data).await.is_none());
    let (status, _) = get(&b, &carol, &format!("/v1/download/{s}/{data}")).await;
    assert_eq!(status, 404);
    let (status, body) = delete(&b, &carol, &format!("/v1/sessions/{s}/objects/{data}")).await;
    assert_eq!(status, 404, "{body}");
    // A token without a tenant is in LibreChat's default one, not in t1.
    assert!(fresh(&b, &jwt_in("alice", None), &s, &data).await.is_none());
    // So is an API-key caller, even naming the uploader.
    assert!(fresh(&b, &keyed(KEY, Some("alice")), &s, &data)
        .await
        .is_none());
    assert!(fresh(&b, &keyed(KEY, None), &s, &data).await.is_none());

    // Bob's exec gets the files read-only, in a session of his own; code cannot change
    // them, and they are never reported as his outputs.
    let (status, run) = exec(
        &b,
        &bob,
        json!({"lang": "py", "code": TAMPER, "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    let out = stdout(&run);
    assert!(out.starts_with("read pristine\n"), "{run}");
    if !through_the_runner() {
        for attempt in ["append", "chmod", "remove", "rename"] {
            assert!(
                out.contains(&format!("{attempt} refused")),
                "{attempt}: {out}"
            );
        }
        assert!(out.ends_with("now pristine\n"), "{out}");
    }
    let bob_session = session(&run);
    assert_ne!(bob_session, s, "the exec ran in the shared session");
    // Through the runner the code may move its own copy (SECURITY.md): what it moved is
    // a new file of its session; the shared one is untouched all the same.
    let names: Vec<&str> = run["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .filter(|n| !(through_the_runner() && n.starts_with("skills/moved/")))
        .collect();
    assert_eq!(names, ["out.txt"], "{run}");
    let out_id = run["files"]
        .as_array()
        .and_then(|l| l.iter().find(|f| f["name"] == "out.txt"))
        .and_then(|f| f["id"].as_str())
        .expect("out.txt")
        .to_string();

    // The shared session is as it was: the same two files, the same bytes.
    let (_, listed) = get(&b, &alice, &format!("/v1/files/{s}?detail=full")).await;
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    let object = fresh(&b, &alice, &s, &data).await.expect("still there");
    assert_eq!(object["size"], DATA.len());

    // The next user gets the pristine file, in her own session.
    let (status, run) = exec(
        &b,
        &alice,
        json!({"lang": "bash", "code": "cat skills/demo/data.txt; ls", "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert!(stdout(&run).starts_with(DATA), "{run}");
    assert!(
        !stdout(&run).contains("out.txt"),
        "bob's output in alice's: {run}"
    );
    let alice_session = session(&run);
    assert_ne!(alice_session, s);
    assert_ne!(alice_session, bob_session);
    // So does bob's next call, which finds his session again by the same refs (even
    // after his code changed his copy, when it could).
    let (status, run) = exec(
        &b,
        &bob,
        json!({"lang": "bash", "code": "cat skills/demo/data.txt; ls", "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(session(&run), bob_session, "{run}");
    assert!(stdout(&run).starts_with(DATA), "{run}");
    assert!(stdout(&run).contains("out.txt"), "{run}");

    // Outputs stay private: alice cannot read bob's.
    let (status, _) = get(&b, &alice, &format!("/v1/download/{bob_session}/{out_id}")).await;
    assert_eq!(status, 404);
    let (status, _) = get(&b, &bob, &format!("/v1/download/{bob_session}/{out_id}")).await;
    assert_eq!(status, 200);

    // Carol's exec with the refs runs, and the files are missing, as unknown ones are.
    let (status, run) = exec(
        &b,
        &carol,
        json!({"lang": "bash", "code": "ls skills 2>&1 || echo none", "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert!(stdout(&run).contains("none"), "{run}");
    assert!(stderr(&run).contains("skills/demo/data.txt"), "{run}");
    assert!(
        !stderr(&run).contains("another"),
        "no hint that it exists: {run}"
    );
}

#[tokio::test]
async fn nobody_deletes_or_overwrites_a_shared_file_or_runs_code_in_its_session() {
    let b = broker("shared-hostile").await;
    let alice = jwt_in("alice", Some("t1"));
    let bob = jwt_in("bob", Some("t1"));
    let (s, refs) = upload_skill(&b, &alice).await;
    let data = file_id(&refs, "skills/demo/data.txt").to_string();

    // Deletion: refused to the uploader, another user and the key's whole scope... of
    // this tenant (a key is another tenant: 404).
    for (who, h) in [("alice", &alice), ("bob", &bob)] {
        for path in [
            format!("/v1/sessions/{s}/objects/{data}"),
            format!("/v1/files/{s}/{data}"),
        ] {
            let (status, body) = delete(&b, h, &path).await;
            assert_eq!(status, 403, "{who} {path}: {body}");
            assert_eq!(body["error"], "forbidden");
            assert!(body["message"]
                .as_str()
                .unwrap_or_default()
                .contains("read-only"));
        }
    }
    let (status, _) = delete(&b, &keyed(KEY, None), &format!("/v1/files/{s}/{data}")).await;
    assert_eq!(status, 404);

    // Uploads naming the shared session land in a new one, whatever their kind.
    for kind in ["user", "skill", "agent"] {
        let up = upload(
            &b,
            &bob,
            "/v1/upload",
            &[
                ("kind", kind),
                ("id", SKILL),
                ("version", "3"),
                ("session_id", &s),
            ],
            &[("skills/demo/data.txt", "evil\n")],
        )
        .await;
        assert_ne!(up["storage_session_id"], s.as_str(), "{kind}: {up}");
    }
    // An exec naming the shared session (or hinting at it) runs elsewhere, and what it
    // writes stays out of it.
    for field in ["session_id", "runtime_session_hint"] {
        let (status, run) = exec(
            &b,
            &bob,
            json!({"lang": "bash", "code": "echo evil > skills_note.txt; ls", field: s}),
        )
        .await;
        assert_eq!(status, 200, "{run}");
        assert_ne!(session(&run), s, "{field}: {run}");
    }
    let (_, listed) = get(&b, &alice, &format!("/v1/files/{s}?detail=full")).await;
    let names: Vec<&str> = listed
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|e| e["metadata"]["original-filename"].as_str())
        .collect();
    assert_eq!(names.len(), 2, "{listed}");
    assert!(
        names.iter().all(|n| n.starts_with("skills/demo/")),
        "{listed}"
    );
    let (status, run) = exec(
        &b,
        &alice,
        json!({"lang": "bash", "code": "cat skills/demo/data.txt", "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(stdout(&run), DATA, "{run}");

    // Chat files stay the user's: another user of the tenant gets 404, and 403 for a ref.
    let up = upload(
        &b,
        &alice,
        "/v1/upload",
        &[("kind", "user"), ("id", "alice")],
        &[("notes.txt", "alice only\n")],
    )
    .await;
    let (u, f) = (
        up["storage_session_id"].as_str().expect("s"),
        up["files"][0]["fileId"].as_str().expect("f"),
    );
    let (status, _) = get(&b, &bob, &format!("/v1/sessions/{u}/objects/{f}")).await;
    assert_eq!(status, 404);
    let (status, run) = exec(
        &b,
        &bob,
        json!({"lang": "bash", "code": "cat notes.txt",
               "files": [{"id": f, "storage_session_id": u, "name": "notes.txt", "kind": "user"}]}),
    )
    .await;
    assert_eq!(status, 403, "{run}");
}

#[tokio::test]
async fn with_api_keys_each_key_is_a_tenant_and_its_users_share() {
    let b = broker("shared-keys").await;
    let alice = keyed(KEY, Some("alice"));
    let bob = keyed(KEY, Some("bob"));
    // An agent's file (v0.8.5+ `kind=agent`) and a classic one (`entity_id`).
    let agent = upload(
        &b,
        &alice,
        "/v1/upload",
        &[("kind", "agent"), ("id", "agent_1")],
        &[("lookup.csv", "k,v\na,1\n")],
    )
    .await;
    let classic = upload(
        &b,
        &alice,
        "/v1/upload",
        &[("entity_id", "asst_1")],
        &[("visits.csv", "day,n\nmon,3\n")],
    )
    .await;
    for up in [&agent, &classic] {
        let s = up["session_id"].as_str().expect("session");
        let f = up["files"][0]["fileId"].as_str().expect("file");
        for (who, h, seen) in [
            ("bob", &bob, true),
            ("the key's scope", &keyed(KEY, None), true),
            (
                "another key naming alice",
                &keyed(OTHER_KEY, Some("alice")),
                false,
            ),
            ("a JWT user", &jwt_in("alice", None), false),
        ] {
            let (status, _) = get(&b, h, &format!("/v1/sessions/{s}/objects/{f}")).await;
            assert_eq!(status == 200, seen, "{who}: object {status}");
            let (_, list) = get(
                &b,
                h,
                &format!("/v1/files/{s}?detail=summary&entity_id=asst_1"),
            )
            .await;
            let listed = list
                .as_array()
                .is_some_and(|l| l.iter().any(|e| e["fileId"] == f));
            assert_eq!(listed, seen, "{who}: {list}");
        }
    }
    // Bob's exec with classic refs {id, session_id, name}: both files, read-only, in his
    // own session.
    let refs: Vec<Value> = [&agent, &classic]
        .iter()
        .map(|up| {
            json!({ "id": up["files"][0]["fileId"], "session_id": up["session_id"],
                    "name": up["files"][0]["filename"] })
        })
        .collect();
    let code = "cat lookup.csv visits.csv; echo x >> visits.csv 2>/dev/null || echo read-only";
    let (status, run) = exec(
        &b,
        &bob,
        json!({"lang": "bash", "code": code, "files": refs, "entity_id": "asst_1"}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(stdout(&run), "k,v\na,1\nday,n\nmon,3\nread-only\n", "{run}");
    assert_eq!(run["files"], json!([]), "{run}");
    assert_ne!(session(&run), agent["session_id"].as_str().expect("s"));
    assert_ne!(session(&run), classic["session_id"].as_str().expect("s"));
    // The other key's caller: missing inputs, the code still runs.
    let (status, run) = exec(
        &b,
        &keyed(OTHER_KEY, Some("bob")),
        json!({"lang": "bash", "code": "ls; echo ran", "files": refs}),
    )
    .await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(stdout(&run), "ran\n", "{run}");
    assert!(stderr(&run).contains("visits.csv"), "{run}");
}
