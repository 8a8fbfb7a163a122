//! Package egress: pip and npm in a sandbox install from the registries the operator
//! allows, while the sandbox itself keeps no network. Their HTTP proxy
//! (`HTTPS_PROXY=http://127.0.0.1:PORT` in the container) is a forwarder that carries each
//! connection to the broker; the broker reads the proxy request, applies the policy
//! ([`policy`]: `CODEBROKER_EGRESS`, `CODEBROKER_EGRESS_RESOLVE`), connects out itself and
//! relays the bytes within a budget ([`proxy`]). [`gateway`] is the broker's end: a Unix socket
//! per sandbox, mounted into it, whose connections count against the exec running there.

pub(crate) mod gateway;
pub(crate) mod policy;
pub(crate) mod proxy;
pub(crate) mod tunnel;
