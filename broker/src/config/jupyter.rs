//! Jupyter's kernel protocol at `/jupyter`, for Open WebUI's code interpreter and Jupyter
//! Server's gateway client (docs/JUPYTER.md).

/// How the broker serves Jupyter's clients.
#[derive(Debug, Clone, clap::Args)]
pub struct JupyterConfig {
    /// Serve Jupyter's REST API and kernel WebSocket at `/jupyter`, so Open WebUI (engine
    /// "jupyter") and Jupyter Server (`--GatewayClient.url`) run kernels in codebroker's
    /// sandboxes, with a codebroker API key as the Jupyter token.
    #[arg(long = "jupyter", env = "CODEBROKER_JUPYTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub jupyter: bool,
}
