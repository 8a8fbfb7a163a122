//! `codebroker smoke --url URL [--key K]`: a short end-to-end check of a running broker,
//! the one an operator runs after a deploy. One line per check; the exit status says
//! whether all passed.
//!
//! The checks: `/health`, a hello world in every language the broker reports, a file
//! uploaded, changed by code and downloaded, a matplotlib plot, and a time limit.

use anyhow::{anyhow, bail, ensure, Context};
use sandbox_runner::Language;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// What the `smoke` subcommand takes.
#[derive(Debug, Clone, clap::Args)]
pub struct SmokeArgs {
    /// The broker's base URL, e.g. `http://127.0.0.1:8000` (a trailing `/v1` works too).
    #[arg(long)]
    pub url: String,
    /// An API key, sent as `X-API-Key`; leave out for a broker with `CODEBROKER_AUTH=none`.
    #[arg(long, hide_env_values = true)]
    pub key: Option<String>,
    /// Time limit of each HTTP call, in seconds (a first compile can take a while).
    #[arg(long, default_value_t = 120)]
    pub request_timeout_secs: u64,
}

/// The client side of the checks: base URL, key, and the session they share.
struct Smoke {
    /// The broker's base URL without a trailing slash.
    base: String,
    /// Sent as `X-API-Key` when set.
    key: Option<String>,
    /// HTTP client with the per-call time limit.
    http: reqwest::Client,
    /// The session the checks run in, once the first exec made one.
    session: Option<String>,
}

/// Runs every check, printing one line each; `Ok(false)` when one failed.
pub async fn run(args: SmokeArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout_secs))
        .build()
        .context("cannot build the HTTP client")?;
    let mut smoke = Smoke {
        base: args.url.trim_end_matches('/').to_string(),
        key: args.key.filter(|k| !k.is_empty()),
        http,
        session: None,
    };
    let mut tally = Tally::default();
    let started = Instant::now();
    let languages = match smoke.health().await {
        Ok(langs) => {
            let detail = format!("{} languages", langs.len());
            tally.report("health", started, Ok(detail));
            langs
        }
        Err(err) => {
            // Nothing else can work.
            tally.report("health", started, Err(err));
            Vec::new()
        }
    };
    if tally.failed == 0 {
        for lang in &languages {
            let started = Instant::now();
            let outcome = smoke.hello(lang).await;
            tally.report(&format!("hello {lang}"), started, outcome);
        }
        let started = Instant::now();
        let outcome = smoke.file_round_trip().await;
        tally.report("files", started, outcome);
        let started = Instant::now();
        let outcome = smoke.plot().await;
        tally.report("plot", started, outcome);
        let started = Instant::now();
        let outcome = smoke.time_limit().await;
        tally.report("timeout", started, outcome);
    }
    println!("{} passed, {} failed", tally.passed, tally.failed);
    Ok(tally.failed == 0)
}

/// Counts and prints the checks' outcomes.
#[derive(Default)]
struct Tally {
    /// Checks that passed.
    passed: usize,
    /// Checks that failed.
    failed: usize,
}

impl Tally {
    fn report(&mut self, name: &str, started: Instant, outcome: anyhow::Result<String>) {
        let ms = started.elapsed().as_millis();
        match outcome {
            Ok(detail) => {
                self.passed += 1;
                println!("ok    {name:<14} {ms:>6} ms  {detail}");
            }
            Err(err) => {
                self.failed += 1;
                println!("FAIL  {name:<14} {ms:>6} ms  {err:#}");
            }
        }
    }
}

impl Smoke {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn with_key(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(key) => request.header("X-API-Key", key),
            None => request,
        }
    }

    /// `GET /health` must answer 200 with `status: ok`; gives the languages it reports.
    async fn health(&self) -> anyhow::Result<Vec<String>> {
        let resp = self.http.get(self.url("/health")).send().await?;
        let status = resp.status();
        let body: Value = resp.json().await.context("the answer is not JSON")?;
        ensure!(status.is_success(), "{status}: {body}");
        ensure!(body["status"] == "ok", "status is {}", body["status"]);
        let languages = body["languages"]
            .as_array()
            .ok_or_else(|| anyhow!("no languages in {body}"))?
            .iter()
            .filter_map(|l| l.as_str().map(str::to_string))
            .collect::<Vec<_>>();
        ensure!(!languages.is_empty(), "the broker reports no language");
        Ok(languages)
    }

    /// `POST /exec` in the smoke session; the response must be a 200 with JSON.
    async fn exec(&mut self, mut body: Value) -> anyhow::Result<Value> {
        if let Some(session) = &self.session {
            body["session_id"] = json!(session);
        }
        let resp = self
            .with_key(self.http.post(self.url("/exec")).json(&body))
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        // A long exec's answer starts with keep-alive whitespace.
        let json: Value = serde_json::from_str(text.trim())
            .with_context(|| format!("{status}: the answer is not JSON: {text:.200}"))?;
        ensure!(status.is_success(), "{status}: {json}");
        if let Some(error) = json.get("error") {
            bail!("{}: {}", error, json["message"]);
        }
        if let Some(session) = json["session_id"].as_str() {
            self.session = Some(session.to_string());
        }
        Ok(json)
    }

    async fn hello(&mut self, lang: &str) -> anyhow::Result<String> {
        let spec = lang
            .parse::<Language>()
            .map_err(|_| anyhow!("no hello world for this language here"))?
            .spec();
        let out = self
            .exec(json!({ "lang": lang, "code": spec.hello }))
            .await?;
        let stdout = out["stdout"].as_str().unwrap_or_default();
        ensure!(
            stdout.contains(&spec.hello_line()) && out["exit_code"] == 0,
            "stdout {stdout:?}, stderr {:?}, exit {}",
            out["stderr"].as_str().unwrap_or_default(),
            out["exit_code"]
        );
        Ok(format!("{:?}", stdout.trim()))
    }

    /// Upload a file, have Python change it, download the result.
    async fn file_round_trip(&mut self) -> anyhow::Result<String> {
        let content = format!("codebroker smoke {}\n", crate::ids::new_id());
        let mut form = reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(content.clone().into_bytes())
                .file_name("smoke-in.txt")
                .mime_str("text/plain")?,
        );
        if let Some(session) = &self.session {
            form = form.text("session_id", session.clone());
        }
        let resp = self
            .with_key(self.http.post(self.url("/upload")).multipart(form))
            .send()
            .await?;
        let status = resp.status();
        let uploaded: Value = resp.json().await.context("upload: not JSON")?;
        ensure!(status.is_success(), "upload: {status}: {uploaded}");
        let file_id = uploaded["files"][0]["fileId"]
            .as_str()
            .ok_or_else(|| anyhow!("upload: no file id in {uploaded}"))?;
        let session = uploaded["session_id"]
            .as_str()
            .ok_or_else(|| anyhow!("upload: no session_id in {uploaded}"))?
            .to_string();
        self.session = Some(session.clone());
        let out = self
            .exec(json!({
                "lang": "py",
                "code": "text = open('/mnt/data/smoke-in.txt').read()\nopen('/mnt/data/smoke-out.txt', 'w').write(text.upper())\nprint(len(text))",
                "files": [{ "id": file_id, "session_id": session, "name": "smoke-in.txt" }],
            }))
            .await?;
        let made = out["files"]
            .as_array()
            .and_then(|files| files.iter().find(|f| f["name"] == "smoke-out.txt"))
            .ok_or_else(|| anyhow!("smoke-out.txt not reported: {out}"))?;
        let bytes = self.download(made).await?;
        ensure!(
            bytes == content.to_uppercase().as_bytes(),
            "downloaded {:?}",
            String::from_utf8_lossy(&bytes)
        );
        Ok(format!("{} bytes up, changed, down", content.len()))
    }

    /// A matplotlib figure saved by the code comes back as a PNG file.
    async fn plot(&mut self) -> anyhow::Result<String> {
        let out = self
            .exec(json!({
                "lang": "py",
                "code": "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 4, 9, 16])\nplt.savefig('/mnt/data/smoke-plot.png')\nprint('saved')",
            }))
            .await?;
        let png = out["files"]
            .as_array()
            .and_then(|files| files.iter().find(|f| f["name"] == "smoke-plot.png"))
            .ok_or_else(|| anyhow!("smoke-plot.png not reported: {out}"))?;
        let bytes = self.download(png).await?;
        ensure!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
            "not a PNG ({} bytes)",
            bytes.len()
        );
        Ok(format!("{} byte PNG", bytes.len()))
    }

    /// Code that outlives its `timeout` is stopped and the limit reported.
    async fn time_limit(&mut self) -> anyhow::Result<String> {
        let started = Instant::now();
        let out = self
            .exec(json!({
                "lang": "py",
                "code": "import time\nprint('sleeping', flush=True)\ntime.sleep(60)\nprint('woke')",
                "timeout": 1000,
            }))
            .await?;
        let took = started.elapsed();
        let limits = out["limits"].to_string();
        ensure!(
            limits.contains("Time limit exceeded"),
            "no time limit reported: {out}"
        );
        ensure!(
            !out["stdout"].as_str().unwrap_or_default().contains("woke"),
            "the code ran to its end: {out}"
        );
        ensure!(
            took < Duration::from_secs(30),
            "stopped only after {took:?}"
        );
        Ok(format!("stopped after {} ms", took.as_millis()))
    }

    /// The bytes of a file the exec reported.
    async fn download(&self, file: &Value) -> anyhow::Result<Vec<u8>> {
        let id = file["id"]
            .as_str()
            .ok_or_else(|| anyhow!("no id: {file}"))?;
        let session = file["session_id"]
            .as_str()
            .ok_or_else(|| anyhow!("no session_id: {file}"))?;
        let resp = self
            .with_key(
                self.http
                    .get(self.url(&format!("/download/{session}/{id}"))),
            )
            .send()
            .await?;
        let status = resp.status();
        ensure!(status.is_success(), "download: {status}");
        Ok(resp.bytes().await?.to_vec())
    }
}

/// `codebroker healthcheck`: exit 0 when `GET /health` of the broker answers 200. For the
/// container's HEALTHCHECK, so the runtime image needs no curl.
pub async fn healthcheck(url: &str) -> anyhow::Result<()> {
    let resp = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?
        .get(format!("{}/health", url.trim_end_matches('/')))
        .send()
        .await
        .with_context(|| format!("{url} does not answer"))?;
    let status = resp.status();
    ensure!(status.is_success(), "/health answered {status}");
    Ok(())
}
