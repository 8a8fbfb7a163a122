//! Package registries on loopback for the egress suite: `pypiserver` serving wheels the test
//! builds, `verdaccio` serving a package the test publishes, and an HTTPS server with a test
//! CA. All of them are real servers, installed by `make registries` under
//! `tests/registries/` (the suite says so when they are missing).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `tests/registries`, where `make registries` installs the servers.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/registries")
}

/// A server child process, killed when dropped.
pub struct Server {
    /// The process.
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nobody listens on now.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

fn tool(relative: &str) -> PathBuf {
    let path = dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run `make registries` (pypiserver and verdaccio for the egress suite)",
        path.display()
    );
    path
}

/// Waits until something listens on `port` of 127.0.0.1 (the servers listen once ready).
fn wait_until_up(port: u16, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the server for port {port} exited: {status}");
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("nothing listens on port {port} after 60 s");
}

/// Writes a wheel of `name` `version` into `dir`: a module whose `VALUE` is `value`, and
/// `payload` incompressible bytes beside it (for a wheel of a given size). Returns its path.
pub fn build_wheel(dir: &Path, name: &str, version: &str, value: &str, payload: usize) -> PathBuf {
    let script = r#"
import base64, hashlib, os, sys, zipfile
out, name, version, value, payload = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
dist = "%s-%s.dist-info" % (name, version)
files = {
    "%s/__init__.py" % name: ("VALUE = %r\n" % value).encode(),
    "%s/payload.bin" % name: os.urandom(payload),
    dist + "/METADATA": ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)).encode(),
    dist + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: codebroker-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for path, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
record.append(dist + "/RECORD,,")
files[dist + "/RECORD"] = ("\n".join(record) + "\n").encode()
path = os.path.join(out, "%s-%s-py3-none-any.whl" % (name, version))
with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
    for p, data in files.items():
        z.writestr(p, data)
print(path)
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .args([name, version, value, &payload.to_string()])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// pypiserver on 127.0.0.1, serving the wheels in `packages` (no fallback to pypi.org).
pub fn pypiserver(packages: &Path) -> Server {
    let port = free_port();
    let mut child = Command::new(tool(".venv/bin/pypi-server"))
        .args(["run", "-i", "127.0.0.1", "-p", &port.to_string()])
        .args(["-a", ".", "-P", ".", "--disable-fallback"])
        .arg(packages)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("pypi-server");
    wait_until_up(port, &mut child);
    Server { child, port }
}

/// verdaccio 6.8 on 127.0.0.1, its storage under `home`, with nothing upstream.
pub fn verdaccio(home: &Path) -> Server {
    let port = free_port();
    let config = home.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "storage: {storage}\nauth:\n  htpasswd:\n    file: {htpasswd}\n    max_users: 10\n\
             uplinks: {{}}\npackages:\n  '**':\n    access: $all\n    publish: $authenticated\n\
             log: {{ type: stdout, format: pretty, level: warn }}\n",
            storage = home.join("storage").display(),
            htpasswd = home.join("htpasswd").display(),
        ),
    )
    .expect("verdaccio config");
    let mut child = Command::new(tool("node_modules/.bin/verdaccio"))
        .arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("verdaccio");
    wait_until_up(port, &mut child);
    Server { child, port }
}

/// Publishes a package `name` 1.0.0 (`module.exports = { value }`) to the verdaccio on
/// `port`, as a user the test registers.
pub async fn publish_npm(home: &Path, port: u16, name: &str, value: &str) {
    let registry = format!("http://127.0.0.1:{port}/");
    let token: serde_json::Value = reqwest::Client::new()
        .put(format!("{registry}-/user/org.couchdb.user:tester"))
        .json(&serde_json::json!({ "name": "tester", "password": "a-test-password" }))
        .send()
        .await
        .expect("register")
        .json()
        .await
        .expect("token");
    let token = token["token"].as_str().expect("a token").to_string();
    let pkg = home.join(format!("pkg-{name}"));
    std::fs::create_dir_all(&pkg).expect("package dir");
    std::fs::write(
        pkg.join("package.json"),
        serde_json::json!({ "name": name, "version": "1.0.0", "main": "index.js" }).to_string(),
    )
    .expect("package.json");
    std::fs::write(
        pkg.join("index.js"),
        format!("module.exports = {{ value: {value:?} }};\n"),
    )
    .expect("index.js");
    let npmrc = pkg.join(".npmrc");
    std::fs::write(&npmrc, format!("//127.0.0.1:{port}/:_authToken={token}\n")).expect("npmrc");
    let out = Command::new("npm")
        .current_dir(&pkg)
        .args(["publish", "--registry", &registry, "--userconfig"])
        .arg(&npmrc)
        .output()
        .expect("npm publish");
    assert!(
        out.status.success(),
        "npm publish: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An HTTPS server on 127.0.0.1 for the name `host`, its certificate signed by a test CA;
/// answers every GET with `body`. Returns the server and the CA's PEM.
pub fn tls_server(home: &Path, host: &str, body: &str) -> (Server, String) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .current_dir(home)
            .args(args)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=codebroker test CA",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        &format!("/CN={host}"),
    ]);
    std::fs::write(home.join("ext.cnf"), format!("subjectAltName=DNS:{host}\n")).expect("ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    let port = free_port();
    let script = r#"
import http.server, ssl, sys
port, body = int(sys.argv[1]), sys.argv[2].encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("server.pem", "server.key")
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"#;
    let mut child = Command::new("python3")
        .current_dir(home)
        .args(["-c", script, &port.to_string(), body])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("https server");
    wait_until_up(port, &mut child);
    let ca = std::fs::read_to_string(home.join("ca.pem")).expect("ca.pem");
    (Server { child, port }, ca)
}
