//! E2B's paths and the workspace's: E2B's working directory is `/home/user`, which is the
//! session's workspace (`/mnt/data` in the sandbox, where `/home/user` links to it).

use crate::workspace::safe_relative_path;
use std::path::PathBuf;

/// E2B's home directory.
pub(super) const HOME: &str = "/home/user";

/// Why a path is refused: codebroker serves the workspace only.
pub(super) fn outside(path: &str) -> String {
    format!(
        "path '{path}' is outside the workspace: codebroker serves {HOME} only \
         (it is /mnt/data in the sandbox)"
    )
}

/// `path` below the workspace: `""` for its root, else a relative path. Accepts
/// `/home/user/...`, `~/...`, `/mnt/data/...` and relative paths (below `/home/user`, as
/// envd takes them); anything else is `Err` with the reason.
pub(super) fn workspace_relative(path: &str) -> Result<String, String> {
    let path = path.trim();
    let rest = ["/home/user", "~", "/mnt/data"]
        .iter()
        .find_map(|root| {
            path.strip_prefix(root)
                .filter(|r| r.is_empty() || r.starts_with('/'))
        })
        .map(|r| r.trim_start_matches('/'))
        .or_else(|| (!path.starts_with('/')).then_some(path))
        .ok_or_else(|| outside(path))?;
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest == "." {
        return Ok(String::new());
    }
    safe_relative_path(rest)
        .map(|p: PathBuf| p.to_string_lossy().into_owned())
        .ok_or_else(|| outside(path))
}

/// The E2B path of a workspace-relative one.
pub(super) fn e2b_path(relative: &str) -> String {
    if relative.is_empty() {
        HOME.to_string()
    } else {
        format!("{HOME}/{relative}")
    }
}

/// The path the sandbox sees for a workspace-relative one.
pub(super) fn sandbox_path(relative: &str) -> String {
    if relative.is_empty() {
        "/mnt/data".to_string()
    } else {
        format!("/mnt/data/{relative}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn home_tilde_mnt_data_and_relative_paths_are_the_workspace() {
        assert_eq!(workspace_relative("/home/user").unwrap(), "");
        assert_eq!(workspace_relative("/home/user/").unwrap(), "");
        assert_eq!(workspace_relative("/home/user/a/b.txt").unwrap(), "a/b.txt");
        assert_eq!(workspace_relative("~/x.csv").unwrap(), "x.csv");
        assert_eq!(workspace_relative("/mnt/data/x").unwrap(), "x");
        assert_eq!(workspace_relative("rel/x").unwrap(), "rel/x");
        assert_eq!(workspace_relative(".").unwrap(), "");
        assert_eq!(e2b_path("a/b"), "/home/user/a/b");
        assert_eq!(sandbox_path(""), "/mnt/data");
    }

    #[test]
    fn paths_that_leave_the_workspace_are_refused() {
        for bad in [
            "/",
            "/etc/passwd",
            "/home/userx",
            "/home/user/../x",
            "../x",
            "/tmp/a",
        ] {
            let err = workspace_relative(bad).unwrap_err();
            assert!(err.contains("outside the workspace"), "{bad}: {err}");
        }
    }
}
