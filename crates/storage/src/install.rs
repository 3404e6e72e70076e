//! `setup` and `fetch-experts-all`: installing a checkpoint from the hub, shared by `cargo xtask` and the
//! `deltafin` CLI so both do exactly the same thing.
//!
//! A full install downloads every file whole (resumable: a shard is written to `NAME.partial` and renamed
//! when complete). A streaming install downloads the small files, every shard header and every spine span
//! into sparse shard files ([`StreamInstall`]) and leaves the experts for later: on demand while the engine
//! runs, or all at once with [`fetch_experts_all`]. Both are resumable: run them again after an interruption.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};
use crate::files::ModelFiles;
use crate::index::INDEX_FILE;
use crate::remote::{Hub, HubOptions, RepoRef};
use crate::streaming_install::{
    InstallInfo, InstallMode, Missing, Progress, StreamInstall, shard_names,
};

/// The repository installed by default.
pub const DEFAULT_REPO: &str = "moonshotai/Kimi-K3";
/// The revision installed by default.
pub const DEFAULT_REVISION: &str = "main";
/// Files every install needs.
const REQUIRED_FILES: &[&str] = &["config.json"];
/// Files fetched when the repository has them (tokenizer and generation settings).
const OPTIONAL_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "tokenizer.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
/// Free space kept in reserve when deciding whether a full install fits: 2% of the model, at least 1 GiB.
fn reserve(bytes: u64) -> u64 {
    (bytes / 50).max(1 << 30)
}

/// Options of [`setup`].
#[derive(Clone, Debug)]
pub struct SetupOptions {
    /// `owner/name` on the hub.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// The model directory to fill.
    pub dest: PathBuf,
    /// Full or streaming; `None` picks full when the disk has room, else streaming.
    pub mode: Option<InstallMode>,
    /// Endpoint, token and limits.
    pub hub: HubOptions,
}

/// What [`setup`] did.
#[derive(Clone, Debug)]
pub struct SetupReport {
    /// The mode installed.
    pub mode: InstallMode,
    /// Why that mode (the user's flag, or the disk-space comparison).
    pub reason: String,
    /// Experts still missing (streaming installs).
    pub missing: Missing,
}

/// Installs `opts.repo` at `opts.revision` into `opts.dest`. `say` receives one-line notes for the user
/// (the chosen mode and why); `progress` the byte counts.
pub fn setup(
    opts: &SetupOptions,
    progress: &dyn Progress,
    say: &dyn Fn(&str),
) -> Result<SetupReport> {
    let dest = &opts.dest;
    let install_err = |reason: String| StorageError::Install {
        dir: dest.clone(),
        reason,
    };
    std::fs::create_dir_all(dest).map_err(|source| StorageError::Io {
        path: dest.clone(),
        source,
    })?;
    let existing = InstallInfo::read(dest)?;
    let endpoint = opts
        .hub
        .resolve_endpoint(existing.as_ref().map(|i| i.endpoint.as_str()));
    let repo = RepoRef {
        endpoint: endpoint.clone(),
        repo: opts.repo.clone(),
        revision: opts.revision.clone(),
    };
    if let Some(info) = &existing
        && (info.repo != opts.repo || info.revision != opts.revision)
    {
        return Err(install_err(format!(
            "already holds {}@{}; choose another destination for {}@{}",
            info.repo, info.revision, opts.repo, opts.revision
        )));
    }
    let mut hub = Hub::new(repo.clone(), &opts.hub)?;
    let noop = |_: u64| {};
    for name in REQUIRED_FILES {
        if !dest.join(name).is_file() && hub.download_file(name, &dest.join(name), &noop)?.is_none()
        {
            return Err(install_err(format!("the repository has no {name}")));
        }
    }
    // Pin the install to the commit the revision resolved to (kept from an earlier run when resuming), and
    // ask for that commit from here on.
    let commit = existing
        .as_ref()
        .and_then(|i| i.commit.clone())
        .or_else(|| hub.client().observed_commit());
    if let Some(c) = &commit
        && *c != opts.revision
    {
        hub = Hub::new(
            RepoRef {
                revision: c.clone(),
                ..repo
            },
            &opts.hub,
        )?;
    }
    for name in OPTIONAL_FILES.iter().chain([&INDEX_FILE]) {
        if !dest.join(name).is_file() {
            hub.download_file(name, &dest.join(name), &noop)?;
        }
    }
    let total = model_bytes(&hub, dest)?;
    let (mode, reason) = match (opts.mode, &existing) {
        (Some(m), _) => (m, "as asked".to_string()),
        (None, Some(info)) => (info.mode, "resuming the existing install".to_string()),
        (None, None) => {
            let free = free_bytes(dest)?;
            let need = total + reserve(total);
            if free >= need {
                (
                    InstallMode::Full,
                    format!(
                        "the disk has {} free, a full install needs {}",
                        gb(free),
                        gb(need)
                    ),
                )
            } else {
                (
                    InstallMode::Stream,
                    format!(
                        "the disk has {} free but a full install needs {}; experts will be fetched on demand",
                        gb(free),
                        gb(need)
                    ),
                )
            }
        }
    };
    if let Some(info) = &existing
        && info.mode != mode
    {
        return Err(install_err(format!(
            "already a {:?} install; choose another destination for a {mode:?} install",
            info.mode
        )));
    }
    say(&format!(
        "{mode:?} install of {}@{} into {}: {reason}",
        opts.repo,
        opts.revision,
        dest.display()
    )
    .to_lowercase());
    let mut info = InstallInfo {
        mode,
        repo: opts.repo.clone(),
        revision: opts.revision.clone(),
        endpoint,
        commit,
        complete: false,
    };
    info.write(dest)?;
    let missing = match mode {
        InstallMode::Full => {
            download_shards(&hub, dest, total, progress)?;
            // Validates every header end to end.
            ModelFiles::open(dest)?;
            Missing::default()
        }
        InstallMode::Stream => {
            let stream = StreamInstall::open(dest, &opts.hub, progress)?;
            stream.missing_experts(None)
        }
    };
    info.complete = true;
    info.write(dest)?;
    Ok(SetupReport {
        mode,
        reason,
        missing,
    })
}

/// Downloads every shard whole, several at once; shards already complete are skipped.
fn download_shards(hub: &Hub, dest: &Path, total: u64, progress: &dyn Progress) -> Result<()> {
    let names = shard_names(dest)?;
    progress.start("shards", total);
    let mut tasks = Vec::new();
    for name in names {
        let path = dest.join(&name);
        if path.is_file() {
            if let Ok(m) = std::fs::metadata(&path) {
                progress.advance(m.len());
            }
            continue;
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| StorageError::Io {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let client = hub.client().clone();
        tasks.push((name, path, client));
    }
    let advance = |n: u64| progress.advance(n);
    let results = hub.runtime().block_on(async {
        let mut set = Vec::new();
        for (name, path, client) in &tasks {
            set.push(client.download_file_async(name, path, &advance));
        }
        join_all(set).await
    });
    progress.finish();
    for ((name, _, _), r) in tasks.iter().zip(results) {
        if r?.is_none() {
            return Err(StorageError::Install {
                dir: dest.to_path_buf(),
                reason: format!("the repository has no shard {name} although the index names it"),
            });
        }
    }
    Ok(())
}

/// Awaits every future concurrently (each takes an in-flight slot of the client itself).
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// The checkpoint's size: `metadata.total_size` of the index (tensor bytes; headers are a rounding
/// error), or the single file's length.
fn model_bytes(hub: &Hub, dest: &Path) -> Result<u64> {
    let index = dest.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read(&index).map_err(|source| StorageError::Io {
            path: index.clone(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_slice(&text).map_err(|source| StorageError::IndexJson {
                path: index.clone(),
                source,
            })?;
        if let Some(n) = v["metadata"]["total_size"].as_u64() {
            return Ok(n);
        }
        return Err(StorageError::IndexFormat {
            path: index,
            reason: "no metadata.total_size".to_string(),
        });
    }
    hub.get_range("model.safetensors", 0, 8)?
        .total
        .ok_or_else(|| StorageError::Install {
            dir: dest.to_path_buf(),
            reason: "the hub did not say how long model.safetensors is".to_string(),
        })
}

/// Free bytes on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|_| {
            StorageError::Install {
                dir: dir.to_path_buf(),
                reason: "path contains a NUL byte".to_string(),
            }
        })?;
        // SAFETY: statvfs is plain data, so all-zero is a valid value to be overwritten.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: c is a valid NUL-terminated path and st a valid out-pointer for the call.
        let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
        if rc != 0 {
            return Err(StorageError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(u64::MAX)
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// Parses a layer range such as `1-40` or `7` (inclusive, 0-based as in tensor names).
pub fn parse_layers(text: &str) -> Option<RangeInclusive<usize>> {
    let (a, b) = match text.split_once('-') {
        Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
        None => {
            let n = text.trim().parse().ok()?;
            (n, n)
        }
    };
    (a <= b).then_some(a..=b)
}

/// Fills a streaming install: fetches every missing expert of `layers` (all when `None`), resumable.
/// With `dry_run`, only reports what is missing. Returns what was (or would be) fetched.
pub fn fetch_experts_all(
    dir: &Path,
    layers: Option<&RangeInclusive<usize>>,
    dry_run: bool,
    hub: &HubOptions,
    progress: &dyn Progress,
) -> Result<Missing> {
    let stream = StreamInstall::open(dir, hub, progress)?;
    let spans = stream.missing_expert_spans(layers);
    let missing = Missing {
        experts: spans.len() as u64,
        bytes: spans.iter().map(|s| s.len).sum(),
    };
    if !dry_run && !spans.is_empty() {
        stream.fetch_all(&spans, "experts", progress)?;
    }
    Ok(missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges() {
        assert_eq!(parse_layers("1-40"), Some(1..=40));
        assert_eq!(parse_layers("7"), Some(7..=7));
        assert_eq!(parse_layers("9-3"), None);
        assert_eq!(parse_layers("x"), None);
    }
}
