//! Files and paths: symlinks, hard links, special files and hostile names that try to
//! make the broker read, write or wait on something outside a workspace.

use super::*;
use common::stderr;
use serde_json::json;

/// Python that finds the kernel's `display(mime, name)` (the hook `plt.show()` calls) and
/// names it `d`, so that code can send display events naming any path it likes.
const FIND_DISPLAY: &str = "import gc\n\
    d = next(o[0] for o in gc.get_objects() if isinstance(o, list) and len(o) == 1 \
    and getattr(o[0], '__name__', None) == 'display' and hasattr(o[0], '__self__'))\n";

#[tokio::test]
async fn symlinks_out_of_the_workspace_are_never_followed() {
    let broker = TestBroker::start("hh-symlink").await;
    let bystander = Bystander::start(&broker).await;
    let secret = HostSecret::new();
    let host = secret.path.display().to_string();
    // A regular file first, so that it has an id, then every name turned into a link
    // out: to the host file's path, /etc/shadow, / and a parent-relative escape.
    let first = broker
        .run(
            "bash",
            "echo regular > /mnt/data/x && mkdir -p /mnt/data/sub && echo inner > /mnt/data/sub/f",
            None,
        )
        .await;
    let s = session(&first);
    let original_id = first["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "x"))
        .and_then(|f| f["id"].as_str())
        .expect("x harvested")
        .to_string();
    // `ls -A`, not `ls -la`: under the runsc Debian ships, coreutils' statx fails (EINVAL).
    let plant = format!(
        "cd /mnt/data && ln -sfn {host:?} x && ln -sfn /etc/shadow shadow && ln -sfn / root \
         && ln -sfn ../../../../../../ up && ln -sfn {host:?} host && rm -rf sub && ln -sfn / sub \
         && ls -A && echo planted"
    );
    let out = broker.run("bash", &plant, Some(&s)).await;
    assert!(stdout(&out).contains("planted"), "{out}");
    assert!(
        out["files"].as_array().is_some_and(|f| f.is_empty()),
        "links were reported as files: {out}"
    );
    // Through the links, nothing: not listed, and the old id still serves the old bytes.
    let names = listed_names(&broker, &s).await;
    for link in ["shadow", "root", "up", "host"] {
        assert!(
            !names.contains(&link.to_string()),
            "{link} listed: {names:?}"
        );
    }
    let resp = broker.get(&format!("/download/{s}/{original_id}")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "regular\n");
    // Downloads by a path instead of an id are refused.
    for path in [
        format!("/download/{s}/..%2F..%2F..%2Fetc%2Fpasswd"),
        format!("/download/{s}/x"),
        format!("/download/..%2F{s}/{original_id}"),
        format!("/files/{s}/..%2Fshadow"),
    ] {
        let resp = broker.get(&path).await;
        assert!(
            matches!(resp.status().as_u16(), 400 | 404 | 405),
            "{path}: {}",
            resp.status()
        );
    }
    // An upload to a linked name replaces the link; it never writes through it.
    let (status, body) = upload_raw(&broker, "/upload", b"x", b"uploaded", Some(&s)).await;
    assert_eq!(status, 200, "{body}");
    // An upload beneath a linked directory is refused with a clear 409.
    let (status, body) = upload_raw(&broker, "/upload", b"sub/planted.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    assert!(!Path::new("/planted.txt").exists());
    let (status, body) = upload_raw(&broker, "/upload", b"root/tmp/p.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = upload_raw(&broker, "/upload", b"host/p.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    let check = broker
        .run(
            "bash",
            "cat /mnt/data/x; test -L /mnt/data/x && echo STILL-LINK; true",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check), "uploaded", "{check}");
    // A display event naming a link shows no bytes of its target.
    let streamed = broker
        .client
        .post(broker.url("/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({ "lang": "py", "session_id": s, "code":
            format!("{FIND_DISPLAY}\
             d('image/png', 'shadow'); d('image/png', 'host'); d('image/png', '../../../etc/passwd')\n\
             print('shown')") }))
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("stream body");
    assert!(streamed.contains("shown"), "{streamed}");
    assert!(!streamed.contains("root:"), "{streamed}");
    let mut displays = 0;
    for line in streamed.lines() {
        let event: Value = serde_json::from_str(line).expect("ndjson");
        if event["event"] == "display" {
            displays += 1;
            assert!(event["data"]["data"].is_null(), "{line}");
        }
    }
    assert_eq!(displays, 3, "{streamed}");
    secret.assert_contained(&broker.data);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn a_symlink_swapped_in_during_the_harvest_is_contained() {
    let broker = TestBroker::start("hh-race").await;
    let bystander = Bystander::start(&broker).await;
    let secret = HostSecret::new();
    let host = secret.path.display().to_string();
    // A kernel thread keeps swapping a regular file and a link to the host file, so that
    // every harvest runs while the name changes under it.
    let start = format!(
        "import os, threading, time\n\
         SWAP = True\n\
         def swap():\n\
         \x20   n = 0\n\
         \x20   while SWAP:\n\
         \x20       n += 1\n\
         \x20       with open('/mnt/data/.race.tmp', 'w') as f: f.write('regular %d' % n)\n\
         \x20       os.replace('/mnt/data/.race.tmp', '/mnt/data/race.txt')\n\
         \x20       time.sleep(0.0005)\n\
         \x20       try: os.unlink('/mnt/data/.race.lnk')\n\
         \x20       except FileNotFoundError: pass\n\
         \x20       os.symlink({host:?}, '/mnt/data/.race.lnk')\n\
         \x20       os.replace('/mnt/data/.race.lnk', '/mnt/data/race.txt')\n\
         \x20       time.sleep(0.0005)\n\
         threading.Thread(target=swap, daemon=True).start()\n\
         print('racing')"
    );
    let out = broker.run("py", &start, None).await;
    let s = session(&out);
    assert_eq!(stdout(&out), "racing\n", "{out}");
    // The same from a shell process left behind by a bash exec.
    let shell = format!(
        "(cd /mnt/data; for i in $(seq 1 20000); do echo shell $i > .sh.tmp; mv -f .sh.tmp shell.txt; \
         ln -sfn {host:?} .sh.lnk; mv -Tf .sh.lnk shell.txt; done) > /dev/null 2>&1 &\necho started"
    );
    let out = broker.run("bash", &shell, Some(&s)).await;
    assert!(stdout(&out).contains("started"), "{out}");
    let mut harvested = 0;
    for _ in 0..15 {
        let out = broker.run("py", "print('tick')", Some(&s)).await;
        for (name, bytes) in download_all(&broker, &out).await {
            harvested += 1;
            assert!(
                !contains(&bytes, secret.content.as_bytes()),
                "{name} served the host file"
            );
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                text.starts_with("regular ") || text.starts_with("shell "),
                "{name}: {text:?}"
            );
        }
    }
    assert!(harvested > 0, "the race never produced a regular file");
    let out = broker
        .run("py", "SWAP = False\nprint('stopped')", Some(&s))
        .await;
    assert_eq!(stdout(&out), "stopped\n", "{out}");
    secret.assert_contained(&broker.data);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn fifos_sockets_and_device_names_never_block_the_host() {
    let broker = TestBroker::start("hh-fifo").await;
    let bystander = Bystander::start(&broker).await;
    let code = "cd /mnt/data\n\
        mkfifo fifo && mkfifo data.csv && echo fifo-made\n\
        python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.bind('/mnt/data/sock'); print('sock-made')\"\n\
        mknod dev c 1 5 2>/dev/null && echo MKNOD-WORKED || echo mknod-refused\n\
        echo plain > null; echo plain > con; echo plain > 'aux.txt'\n\
        ln -s /dev/zero zero; ln -s /dev/urandom random; ln -s /proc/self/fd/0 stdin; ln -s /dev/tty tty\n\
        mkdir -p dev && ln -s /dev/zero dev/zero\n\
        echo done";
    let started = Instant::now();
    let out = broker.run("bash", code, None).await;
    let s = session(&out);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the harvest hung"
    );
    let text = stdout(&out);
    assert!(text.contains("fifo-made"), "{out}");
    assert!(text.contains("sock-made"), "{out}");
    assert!(text.contains("mknod-refused"), "{out}");
    assert!(text.contains("done"), "{out}");
    let mut names = names_of(&out);
    names.sort();
    assert_eq!(names, ["aux.txt", "con", "null"], "{out}");
    for (_, bytes) in download_all(&broker, &out).await {
        assert_eq!(bytes, b"plain\n");
    }
    // The names once more, through every host path that touches them: another harvest,
    // uploads over them, a display of them, input refs onto them.
    let again = broker.run("bash", "touch /mnt/data/other", Some(&s)).await;
    assert_eq!(names_of(&again), ["other"], "{again}");
    for name in ["fifo", "sock", "zero", "dev/zero", "data.csv"] {
        let started = Instant::now();
        let (status, body) =
            upload_raw(&broker, "/upload", name.as_bytes(), b"uploaded", Some(&s)).await;
        assert!(started.elapsed() < Duration::from_secs(10), "{name} hung");
        assert_eq!(status, 200, "{name}: {body}");
    }
    let check = broker
        .run(
            "bash",
            "cd /mnt/data; for f in fifo sock zero dev/zero data.csv; do test -f $f && cat $f; echo; done",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check), "uploaded\n".repeat(5), "{check}");
    let streamed = tokio::time::timeout(
        Duration::from_secs(30),
        broker
            .client
            .post(broker.url("/exec/stream"))
            .header("accept", "application/x-ndjson")
            .json(&json!({ "lang": "py", "session_id": s, "code":
                format!("import os\n{FIND_DISPLAY}os.mkfifo('/mnt/data/plot.png')\n\
                 d('image/png', 'plot.png')\nprint('shown')") }))
            .send(),
    )
    .await
    .expect("a display of a FIFO hung")
    .expect("stream");
    let body = tokio::time::timeout(Duration::from_secs(30), streamed.text())
        .await
        .expect("a display of a FIFO hung")
        .expect("body");
    assert!(body.contains("shown"), "{body}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn hard_links_cannot_reach_files_outside_the_workspace() {
    let broker = TestBroker::start("hh-hardlink").await;
    let bystander = Bystander::start(&broker).await;
    // /etc and /tmp are other filesystems than the workspace's bind mount: link(2) fails
    // with EXDEV, so no host or image file can be given a name in /mnt/data.
    let code = "cd /mnt/data\n\
        echo tmp > /tmp/t\n\
        for src in /etc/passwd /tmp/t /proc/self/status /opt/codebroker/libraries.json; do\n\
          ln \"$src\" \"link$(echo $src | tr / _)\" 2>&1 && echo LINKED $src\n\
        done\n\
        echo inside > a && ln a b && echo inner-linked\n\
        echo done";
    let out = broker.run("bash", code, None).await;
    let s = session(&out);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!text.contains("LINKED"), "{out}");
    assert!(
        text.matches("Invalid cross-device link").count() >= 3,
        "{out}"
    );
    assert!(
        text.contains("inner-linked") && text.contains("done"),
        "{out}"
    );
    let mut names = names_of(&out);
    names.sort();
    assert_eq!(names, ["a", "b"], "{out}");
    // A hard link to an uploaded read-only file does not make it writable through the
    // other name's harvest either: the read-only upload keeps its bytes.
    let (status, body) = upload_raw(&broker, "/upload", b"ro.txt", b"pinned", Some(&s)).await;
    assert_eq!(status, 200, "{body}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn hostile_upload_names_are_refused_or_confined() {
    let broker = TestBroker::start("hh-names").await;
    let bystander = Bystander::start(&broker).await;
    let first = broker.run("bash", "echo start", None).await;
    let s = session(&first);
    let long_component = "a".repeat(4096);
    let long_path = format!("{}/x", vec!["d"; 600].join("/"));
    let refused: Vec<Vec<u8>> = vec![
        b"../../etc/x".to_vec(),
        b"/etc/x".to_vec(),
        b"a\0b".to_vec(),
        b"x/../../y".to_vec(),
        b"x/../y".to_vec(),
        b"..".to_vec(),
        b"/".to_vec(),
        long_component.clone().into_bytes(),
        long_path.clone().into_bytes(),
    ];
    for name in &refused {
        for route in ["/upload", "/upload/batch"] {
            let (status, body) = upload_raw(&broker, route, name, b"evil", Some(&s)).await;
            let shown = String::from_utf8_lossy(&name[..name.len().min(40)]).into_owned();
            match route {
                "/upload" => {
                    assert_eq!(status, 400, "{shown}: {body}");
                    assert!(body["message"].is_string(), "{shown}: {body}");
                }
                _ => {
                    assert!(
                        status == 400 || body["failed"] == 1,
                        "{shown}: {status} {body}"
                    );
                }
            }
        }
    }
    // Names that are odd but harmless land beneath /mnt/data, byte for byte.
    let zip = zip_with_escaping_entry();
    let confined: Vec<(&[u8], &[u8])> = vec![
        (b"a.zip", &zip),
        (b"..\\..\\windows.txt", b"backslashes"),
        (b"./dot/./x.txt", b"dots"),
        (b"nested//double.txt", b"double"),
        (b"-rf", b"dash"),
        (b"$(touch pwned).txt", b"shell"),
    ];
    for (name, content) in &confined {
        let (status, body) = upload_raw(&broker, "/upload", name, content, Some(&s)).await;
        assert_eq!(status, 200, "{}: {body}", String::from_utf8_lossy(name));
        let id = body["files"][0]["id"].as_str().expect("id");
        let resp = broker.get(&format!("/download/{s}/{id}")).await;
        assert_eq!(resp.bytes().await.unwrap().as_ref(), *content);
    }
    let listing = broker
        .run(
            "bash",
            "cd /mnt/data && find . -mindepth 1 | sort; ls / | grep -c pwned; true",
            Some(&s),
        )
        .await;
    let found = stdout(&listing);
    for expected in [
        "./a.zip",
        "./..\\..\\windows.txt",
        "./dot/x.txt",
        "./nested/double.txt",
        "./-rf",
        "./$(touch pwned).txt",
    ] {
        assert!(found.contains(expected), "{expected} missing: {found}");
    }
    // The archive is a file: never unpacked, so its `../` entry exists nowhere.
    assert!(!found.contains("escaped"), "{found}");
    for path in walk(&broker.data) {
        assert!(
            !path.to_string_lossy().contains("escaped"),
            "{}",
            path.display()
        );
        assert!(!path.to_string_lossy().contains("evil"));
    }
    assert!(!broker.data.join("etc").exists());
    // Nothing was staged and left behind by the refusals.
    let staged: Vec<_> = walk(&broker.data.join("staging"));
    assert!(staged.is_empty(), "{staged:?}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

/// A stored (uncompressed) zip archive with one entry named `../../escaped.txt`.
fn zip_with_escaping_entry() -> Vec<u8> {
    let name = b"../../escaped.txt";
    let data = b"escaped";
    let crc = crc32(data);
    let mut out = Vec::new();
    let local = |out: &mut Vec<u8>| {
        out.extend_from_slice(&0x04034b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(data);
    };
    local(&mut out);
    let central_at = out.len() as u32;
    out.extend_from_slice(&0x02014b50u32.to_le_bytes());
    out.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0; 12]);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(name);
    let central_len = out.len() as u32 - central_at;
    out.extend_from_slice(&0x06054b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
    out.extend_from_slice(&central_len.to_le_bytes());
    out.extend_from_slice(&central_at.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
