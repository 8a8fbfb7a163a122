//! E2B's SDKs: the control plane at `/e2b`, envd and the code interpreter at
//! `/e2b/sandbox` (docs/E2B.md).

/// How the broker serves E2B's SDKs.
#[derive(Debug, Clone, clap::Args)]
pub struct E2bConfig {
    /// Serve E2B's API at `/e2b` (control plane) and `/e2b/sandbox` (envd and the code
    /// interpreter), so E2B's SDKs run in codebroker's sandboxes with `E2B_API_URL`,
    /// `E2B_SANDBOX_URL` and a codebroker API key as `E2B_API_KEY`.
    #[arg(long = "e2b", env = "CODEBROKER_E2B", default_value_t = true, action = clap::ArgAction::Set)]
    pub e2b: bool,

    /// The domain of host-based routing, behind a TLS proxy with a wildcard certificate:
    /// `api.<domain>` is the control plane, `<port>-<sandbox id>.<domain>` a sandbox's
    /// envd (49983) or interpreter (49999). It is also the `domain` create answers with, so
    /// SDKs that set `E2B_DOMAIN` find the sandboxes there. Empty: path routing only.
    #[arg(long, env = "CODEBROKER_E2B_DOMAIN", default_value = "")]
    pub e2b_domain: String,

    /// The template names a create may ask for, comma-separated; one image serves them all.
    #[arg(
        long,
        env = "CODEBROKER_E2B_TEMPLATES",
        default_value = "base,code-interpreter-v1"
    )]
    pub e2b_templates: String,

    /// Seconds a sandbox lives when its create names no timeout (E2B's default).
    #[arg(
        long,
        env = "CODEBROKER_E2B_DEFAULT_TIMEOUT_SECS",
        default_value_t = 300
    )]
    pub e2b_default_timeout_secs: u64,

    /// Most seconds a create, a connect or a set-timeout may ask for; more is a 400.
    #[arg(
        long,
        env = "CODEBROKER_E2B_MAX_TIMEOUT_SECS",
        default_value_t = 86_400
    )]
    pub e2b_max_timeout_secs: u64,

    /// The envd version sandboxes report. The SDKs switch features on it; 0.5.7 turns on
    /// the octet-stream uploads codebroker serves and turns off file metadata it does not.
    #[arg(long, env = "CODEBROKER_E2B_ENVD_VERSION", default_value = "0.5.7")]
    pub e2b_envd_version: String,
}

impl E2bConfig {
    /// The template names a create may ask for.
    pub(crate) fn templates(&self) -> Vec<&str> {
        self.e2b_templates
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .collect()
    }
}
