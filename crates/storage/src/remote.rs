//! The hub client: HTTP/1.1 range requests for spans of checkpoint files, and resumable whole-file downloads.
//!
//! URLs follow the Hugging Face scheme `{endpoint}/{repo}/resolve/{revision}/{file}`. The hub answers a
//! `resolve` request for a large file with a redirect to its CDN; redirects are followed here, by hand,
//! so that the `Range` header is kept on every hop and the access token is sent only to the endpoint's
//! own origin (scheme, host and port), never to the CDN. Every ranged answer is checked: status 206, a
//! `Content-Range` naming exactly the bytes asked for, and a body of exactly that length. Connection
//! resets, stalls, 5xx answers, short bodies and inconsistent ranges are retried with exponential
//! backoff. The token never enters a URL, a log line or an error message.
//!
//! reqwest's client is asynchronous; a private tokio runtime drives it so the rest of deltafin stays
//! synchronous. Connections are kept alive and reused, and several requests are in flight at once.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, LOCATION, RANGE};
use reqwest::{StatusCode, Url};

use crate::error::{Result, StorageError};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Redirect hops followed before giving up.
const MAX_REDIRECTS: usize = 5;

/// A secret (the hub access token). Its `Debug` shows only whether it is set; it has no `Display`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(Option<String>);

impl Secret {
    /// Wraps a token; an empty string means none.
    pub fn new(token: Option<String>) -> Self {
        Self(token.filter(|t| !t.is_empty()))
    }

    /// `HF_TOKEN` from the environment.
    pub fn from_env() -> Self {
        Self::new(std::env::var("HF_TOKEN").ok())
    }

    /// Whether a token is set.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    fn expose(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "Secret(set)"
        } else {
            "Secret(none)"
        })
    }
}

/// How to talk to the hub.
#[derive(Clone, Debug)]
pub struct HubOptions {
    /// Endpoint override; `None` means `HF_ENDPOINT`, then whatever the install recorded, then
    /// [`DEFAULT_ENDPOINT`].
    pub endpoint: Option<String>,
    /// Access token; `None` means `HF_TOKEN`.
    pub token: Option<Secret>,
    /// Requests in flight at once.
    pub max_in_flight: usize,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubles each time, capped at 8 s.
    pub backoff: Duration,
    /// A response that delivers no byte for this long is abandoned and retried.
    pub idle_timeout: Duration,
    /// Limit for establishing a connection.
    pub connect_timeout: Duration,
}

impl Default for HubOptions {
    fn default() -> Self {
        Self {
            endpoint: None,
            token: None,
            max_in_flight: 8,
            max_attempts: 6,
            backoff: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(15),
        }
    }
}

impl HubOptions {
    /// The endpoint to use: the explicit one, else `HF_ENDPOINT`, else `recorded`, else the public hub.
    pub fn resolve_endpoint(&self, recorded: Option<&str>) -> String {
        let chosen = self
            .endpoint
            .clone()
            .or_else(|| std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()))
            .or_else(|| recorded.map(str::to_string))
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        chosen.trim_end_matches('/').to_string()
    }

    /// The token to use: the explicit one, else `HF_TOKEN`.
    pub fn resolve_token(&self) -> Secret {
        self.token.clone().unwrap_or_else(Secret::from_env)
    }
}

/// Where a repository lives on the hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    /// Endpoint without a trailing slash, e.g. `https://huggingface.co`.
    pub endpoint: String,
    /// `owner/name`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
}

impl RepoRef {
    /// `{endpoint}/{repo}/resolve/{revision}/{file}`, with unusual characters percent-encoded.
    pub fn url(&self, file: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            encode_path(&self.repo),
            encode_path(&self.revision),
            encode_path(file)
        )
    }
}

/// Percent-encodes everything but unreserved characters and `/`.
fn encode_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What one attempt came to.
enum Attempt<T> {
    Done(T),
    /// Worth another try after a backoff.
    Retry(String),
    /// Retrying cannot help.
    Fatal(String),
}

/// A ranged answer: the bytes and the file's total length from `Content-Range` (if the server said).
#[derive(Debug)]
pub struct RangeBody {
    /// Exactly the bytes asked for.
    pub bytes: Vec<u8>,
    /// The whole file's length.
    pub total: Option<u64>,
}

/// A hub client bound to one repository revision: async requests, cheap to clone into tasks. [`Hub`]
/// owns one with the runtime that drives it.
#[derive(Clone)]
pub struct HubClient {
    repo: RepoRef,
    origin: Option<(String, String, Option<u16>)>,
    token: Secret,
    client: reqwest::Client,
    in_flight: Arc<tokio::sync::Semaphore>,
    opts: HubOptions,
    /// The last `X-Repo-Commit` the hub sent: the commit a branch or tag resolved to.
    commit: Arc<std::sync::Mutex<Option<String>>>,
}

/// Header in which the hub names the commit a `resolve` request was served from.
const REPO_COMMIT: &str = "x-repo-commit";

/// A [`HubClient`] and the private runtime that drives it, with blocking methods.
pub struct Hub {
    client: HubClient,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.client.fmt(f)
    }
}

impl Hub {
    /// A client for `repo` (whose endpoint is already resolved) with `opts`' limits and token.
    pub fn new(repo: RepoRef, opts: &HubOptions) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("deltafin-http")
            .enable_all()
            .build()
            .map_err(|e| StorageError::Http {
                url: repo.endpoint.clone(),
                range: String::new(),
                reason: format!("cannot start the http runtime: {e}"),
            })?;
        let client = HubClient::new(repo, opts)?;
        Ok(Self { client, runtime })
    }

    /// The async client, for tasks spawned on [`Hub::runtime`].
    pub fn client(&self) -> &HubClient {
        &self.client
    }

    /// The runtime the client's connections live on.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }

    /// The repository.
    pub fn repo(&self) -> &RepoRef {
        &self.client.repo
    }

    /// Fetches `len` bytes at `offset` of `file` (blocking), with retries.
    pub fn get_range(&self, file: &str, offset: u64, len: u64) -> Result<RangeBody> {
        self.runtime
            .block_on(self.client.get_range_async(file, offset, len))
    }

    /// Downloads `file` whole into `dest`, resuming from `dest` + `.partial` if an earlier run left
    /// one. Returns `Ok(None)` when the hub has no such file (404), else the file's length. `progress`
    /// hears of every byte written.
    pub fn download_file(
        &self,
        file: &str,
        dest: &Path,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Option<u64>> {
        self.runtime
            .block_on(self.client.download_file_async(file, dest, progress))
    }
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("repo", &self.repo)
            .field("token", &self.token)
            .finish()
    }
}

impl HubClient {
    /// A client for `repo` (whose endpoint is already resolved) with `opts`' limits and token. Needs
    /// a tokio runtime to run on (see [`Hub`]).
    pub fn new(repo: RepoRef, opts: &HubOptions) -> Result<Self> {
        let http_err = |reason: String| StorageError::Http {
            url: repo.endpoint.clone(),
            range: String::new(),
            reason,
        };
        let origin = Url::parse(&repo.endpoint)
            .map_err(|e| http_err(format!("bad endpoint: {e}")))
            .map(|u| origin_of(&u))?;
        let client = reqwest::Client::builder()
            .http1_only()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(opts.connect_timeout)
            .pool_max_idle_per_host(opts.max_in_flight.max(1) * 2)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| http_err(format!("cannot build the http client: {}", chain(e))))?;
        Ok(Self {
            origin: Some(origin),
            token: opts.resolve_token(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(opts.max_in_flight.max(1))),
            repo,
            client,
            opts: opts.clone(),
            commit: Arc::default(),
        })
    }

    /// The repository this client reads.
    pub fn repo(&self) -> &RepoRef {
        &self.repo
    }

    /// The commit the hub last said it served (`X-Repo-Commit`), if it said: setup pins an install to it so
    /// that later range requests cannot mix bytes of two revisions.
    pub fn observed_commit(&self) -> Option<String> {
        self.commit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Fetches `len` bytes at `offset` of `file`, with retries; waits for a free in-flight slot first.
    pub async fn get_range_async(&self, file: &str, offset: u64, len: u64) -> Result<RangeBody> {
        let url = self.repo.url(file);
        let range_text = format!(" (bytes {}-{})", offset, offset + len.saturating_sub(1));
        let fail = |reason: String| StorageError::Http {
            url: url.clone(),
            range: range_text.clone(),
            reason,
        };
        if len == 0 {
            return Ok(RangeBody {
                bytes: Vec::new(),
                total: None,
            });
        }
        let _permit = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| fail("client is shutting down".to_string()))?;
        let mut last = String::new();
        for attempt in 0..self.opts.max_attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(self.backoff(attempt)).await;
            }
            match self.try_range(&url, offset, len).await {
                Attempt::Done(body) => return Ok(body),
                Attempt::Fatal(reason) => return Err(fail(reason)),
                Attempt::Retry(reason) => {
                    tracing::debug!(url = %url, attempt, reason = %reason, "retrying range request");
                    last = reason;
                }
            }
        }
        Err(fail(format!(
            "gave up after {} attempts; last: {last}",
            self.opts.max_attempts.max(1)
        )))
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        self.opts
            .backoff
            .saturating_mul(factor)
            .min(Duration::from_secs(8))
    }

    /// One attempt at a range request.
    async fn try_range(&self, url: &str, offset: u64, len: u64) -> Attempt<RangeBody> {
        let last = offset + len - 1;
        let range = format!("bytes={offset}-{last}");
        let mut resp = match self.send(url, Some(&range)).await {
            Attempt::Done(r) => r,
            Attempt::Retry(r) => return Attempt::Retry(r),
            Attempt::Fatal(r) => return Attempt::Fatal(r),
        };
        let status = resp.status();
        if status != StatusCode::PARTIAL_CONTENT {
            return status_verdict(status, "expected 206 partial content");
        }
        let Some(cr) = resp
            .headers()
            .get(CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
        else {
            return Attempt::Retry("206 without content-range".to_string());
        };
        let Some((start, end, total)) = parse_content_range(&cr) else {
            return Attempt::Retry(format!("unparseable content-range {cr:?}"));
        };
        if start != offset || end != last {
            return Attempt::Retry(format!(
                "content-range {cr:?} does not match the requested bytes {offset}-{last}"
            ));
        }
        if let Some(cl) = content_length(&resp)
            && cl != len
        {
            return Attempt::Retry(format!("content-length {cl}, expected {len}"));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        match self.read_body(&mut resp, &mut bytes, len).await {
            Ok(()) => {}
            Err(reason) => return Attempt::Retry(reason),
        }
        if bytes.len() as u64 != len {
            return Attempt::Retry(format!("short body: {} of {len} bytes", bytes.len()));
        }
        Attempt::Done(RangeBody { bytes, total })
    }

    /// Reads the body into `out`, failing on a stall, a connection error or more than `limit` bytes.
    async fn read_body(
        &self,
        resp: &mut reqwest::Response,
        out: &mut Vec<u8>,
        limit: u64,
    ) -> std::result::Result<(), String> {
        loop {
            match tokio::time::timeout(self.opts.idle_timeout, resp.chunk()).await {
                Err(_) => {
                    return Err(format!(
                        "no data for {:?} after {} bytes",
                        self.opts.idle_timeout,
                        out.len()
                    ));
                }
                Ok(Err(e)) => {
                    return Err(format!(
                        "body error after {} bytes: {}",
                        out.len(),
                        chain(e)
                    ));
                }
                Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(chunk))) => {
                    if out.len() as u64 + chunk.len() as u64 > limit {
                        return Err(format!("body longer than the {limit} bytes asked for"));
                    }
                    out.extend_from_slice(&chunk);
                }
            }
        }
    }

    /// Sends a GET, following redirects by hand: the `Range` header goes on every hop, the token only
    /// to the endpoint's origin.
    async fn send(&self, url: &str, range: Option<&str>) -> Attempt<reqwest::Response> {
        let mut current = match Url::parse(url) {
            Ok(u) => u,
            Err(e) => return Attempt::Fatal(format!("bad url: {e}")),
        };
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.client.get(current.clone());
            if let Some(r) = range {
                req = req.header(RANGE, r);
            }
            if let Some(token) = self.token.expose()
                && Some(origin_of(&current)) == self.origin
            {
                req = req.header(AUTHORIZATION, format!("Bearer {token}"));
            }
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) => return Attempt::Retry(format!("request failed: {}", chain(e))),
            };
            if let Some(commit) = resp
                .headers()
                .get(REPO_COMMIT)
                .and_then(|v| v.to_str().ok())
                .filter(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_alphanumeric()))
            {
                *self.commit.lock().unwrap_or_else(|e| e.into_inner()) = Some(commit.to_string());
            }
            if !resp.status().is_redirection() {
                return Attempt::Done(resp);
            }
            let Some(location) = resp.headers().get(LOCATION).and_then(|v| v.to_str().ok()) else {
                return Attempt::Fatal(format!("{} redirect without a location", resp.status()));
            };
            current = match current.join(location) {
                Ok(u) => u,
                Err(e) => return Attempt::Fatal(format!("bad redirect location: {e}")),
            };
        }
        Attempt::Fatal(format!("more than {MAX_REDIRECTS} redirects"))
    }

    /// The async form of [`Hub::download_file`].
    pub async fn download_file_async(
        &self,
        file: &str,
        dest: &Path,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Option<u64>> {
        let url = self.repo.url(file);
        let fail = |reason: String| StorageError::Http {
            url: url.clone(),
            range: String::new(),
            reason,
        };
        let _permit = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| fail("client is shutting down".to_string()))?;
        let partial = partial_path(dest);
        let mut last = String::new();
        for attempt in 0..self.opts.max_attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(self.backoff(attempt)).await;
            }
            match self.try_download(&url, &partial, progress).await {
                Attempt::Done(None) => return Ok(None),
                Attempt::Done(Some(total)) => {
                    std::fs::rename(&partial, dest).map_err(|source| StorageError::Io {
                        path: dest.to_path_buf(),
                        source,
                    })?;
                    if let Some(parent) = dest.parent() {
                        crate::span_cache::fsync_dir(parent)?;
                    }
                    return Ok(Some(total));
                }
                Attempt::Fatal(reason) => return Err(fail(reason)),
                Attempt::Retry(reason) => {
                    tracing::debug!(url = %url, attempt, reason = %reason, "retrying download");
                    last = reason;
                }
            }
        }
        Err(fail(format!(
            "gave up after {} attempts; last: {last}",
            self.opts.max_attempts.max(1)
        )))
    }

    /// One attempt at (the rest of) a whole-file download into `partial`.
    async fn try_download(
        &self,
        url: &str,
        partial: &Path,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Attempt<Option<u64>> {
        let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
        let range = (have > 0).then(|| format!("bytes={have}-"));
        let mut resp = match self.send(url, range.as_deref()).await {
            Attempt::Done(r) => r,
            Attempt::Retry(r) => return Attempt::Retry(r),
            Attempt::Fatal(r) => return Attempt::Fatal(r),
        };
        let status = resp.status();
        let (start, total) = match status {
            StatusCode::NOT_FOUND if have == 0 => return Attempt::Done(None),
            StatusCode::OK => (0, content_length(&resp)),
            StatusCode::PARTIAL_CONTENT => {
                let cr = resp
                    .headers()
                    .get(CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_content_range);
                match cr {
                    Some((s, _, total)) if s == have => (have, total),
                    _ => {
                        return Attempt::Retry(
                            "content-range does not continue the partial file".to_string(),
                        );
                    }
                }
            }
            StatusCode::RANGE_NOT_SATISFIABLE if have > 0 => {
                // The partial file is as long as (or longer than) the remote one: start over.
                if let Err(e) = std::fs::remove_file(partial) {
                    return Attempt::Fatal(format!("cannot remove {}: {e}", partial.display()));
                }
                return Attempt::Retry("partial file is longer than the remote file".to_string());
            }
            s => return status_verdict(s, "expected 200 or 206"),
        };
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(start == 0)
            .open(partial);
        let mut file: File = match file {
            Ok(f) => f,
            Err(e) => return Attempt::Fatal(format!("cannot open {}: {e}", partial.display())),
        };
        if start > 0 {
            use std::io::Seek;
            if let Err(e) = file.seek(std::io::SeekFrom::Start(start)) {
                return Attempt::Fatal(format!("cannot seek {}: {e}", partial.display()));
            }
            progress(start);
        }
        let mut written = start;
        loop {
            match tokio::time::timeout(self.opts.idle_timeout, resp.chunk()).await {
                Err(_) => {
                    return Attempt::Retry(format!("no data for {:?}", self.opts.idle_timeout));
                }
                Ok(Err(e)) => return Attempt::Retry(format!("body error: {}", chain(e))),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => {
                    if let Err(e) = file.write_all(&chunk) {
                        return Attempt::Fatal(format!("cannot write {}: {e}", partial.display()));
                    }
                    written += chunk.len() as u64;
                    progress(chunk.len() as u64);
                }
            }
        }
        if let Some(total) = total
            && written != total
        {
            return Attempt::Retry(format!("short body: {written} of {total} bytes"));
        }
        if let Err(e) = file.sync_all() {
            return Attempt::Fatal(format!("cannot sync {}: {e}", partial.display()));
        }
        Attempt::Done(Some(written))
    }
}

/// `dest` with `.partial` appended to its file name.
pub(crate) fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

/// What a non-success status means for retrying.
fn status_verdict<T>(status: StatusCode, expected: &str) -> Attempt<T> {
    let msg = format!("status {status}, {expected}");
    if status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
        // A spurious 416 from a CDN edge happens; a persistent one (the remote file changed) still
        // fails after the last attempt.
        || status == StatusCode::RANGE_NOT_SATISFIABLE
    {
        Attempt::Retry(msg)
    } else if status == StatusCode::OK {
        Attempt::Fatal(format!("{msg}: the server ignored the range request"))
    } else if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        Attempt::Fatal(format!(
            "{msg}: access denied (is HF_TOKEN set and allowed to read this repository?)"
        ))
    } else {
        Attempt::Fatal(msg)
    }
}

fn content_length(resp: &reqwest::Response) -> Option<u64> {
    resp.headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// `bytes a-b/total` (total may be `*`) → (a, b, total).
pub(crate) fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    if b < a {
        return None;
    }
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some((a, b, total))
}

/// (scheme, host, port) of a URL.
fn origin_of(u: &Url) -> (String, String, Option<u16>) {
    (
        u.scheme().to_string(),
        u.host_str().unwrap_or_default().to_ascii_lowercase(),
        u.port_or_known_default(),
    )
}

/// An error and its sources on one line, without the URL reqwest would add (the caller names it).
fn chain(e: reqwest::Error) -> String {
    use std::error::Error as _;
    let e = e.without_url();
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range() {
        assert_eq!(
            parse_content_range("bytes 0-7/100"),
            Some((0, 7, Some(100)))
        );
        assert_eq!(parse_content_range("bytes 5-5/*"), Some((5, 5, None)));
        assert_eq!(parse_content_range("bytes 7-0/100"), None);
        assert_eq!(parse_content_range("items 0-7/100"), None);
    }

    #[test]
    fn urls() {
        let r = RepoRef {
            endpoint: "http://127.0.0.1:9".to_string(),
            repo: "moonshotai/Kimi-K3".to_string(),
            revision: "main".to_string(),
        };
        assert_eq!(
            r.url("model-00001-of-000096.safetensors"),
            "http://127.0.0.1:9/moonshotai/Kimi-K3/resolve/main/model-00001-of-000096.safetensors"
        );
        assert_eq!(
            r.url("a b"),
            "http://127.0.0.1:9/moonshotai/Kimi-K3/resolve/main/a%20b"
        );
    }

    #[test]
    fn secret_debug_hides_the_token() {
        let s = Secret::new(Some("hf_abcdef".to_string()));
        assert!(!format!("{s:?}").contains("hf_abcdef"));
        let opts = HubOptions {
            token: Some(s),
            ..HubOptions::default()
        };
        assert!(!format!("{opts:?}").contains("hf_abcdef"));
    }
}
