//! Where deltafin keeps its files on this machine: the root directory and the default install of a repository.
//! Only the frontends know these paths; the library crates take directories as arguments.

use std::path::PathBuf;

/// `DELTAFIN_ROOT`, or the user's cache directory (`XDG_CACHE_HOME`, else `~/.cache`) + `deltafin`.
pub fn root_dir() -> PathBuf {
    if let Some(root) = std::env::var_os("DELTAFIN_ROOT") {
        return PathBuf::from(root);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("deltafin")
}

/// Where `repo` is installed by default: `{root}/models/{name}` (for K3, `{root}/models/Kimi-K3`, the model `run`
/// and `serve` open when none is named).
pub fn default_dest(repo: &str) -> PathBuf {
    let name = repo.rsplit('/').next().unwrap_or(repo);
    root_dir().join("models").join(name)
}
