//! A fake model hub for the streaming-install tests: a real HTTP/1.1 server on 127.0.0.1 that serves a fixture
//! directory under the hub's URL scheme, `/{owner}/{name}/resolve/{revision}/{file}`, honours `Range`, answers
//! requests for `.safetensors` files with a 302 to a second listener (the "CDN", another origin) the way the hub
//! sends large files to its CDN, keeps connections alive, and injects faults on demand.
//!
//! Every request is logged (which listener, path, range, authorization header) so tests can count range
//! requests and check where a token was sent. Built on `std::net` and threads: one thread per connection.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The commit the fake hub says every revision resolves to (`X-Repo-Commit`); it also serves this commit.
pub const FAKE_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A fault to inject into one ranged CDN response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Send the headers and half the body, then reset the connection (RST).
    ResetMidBody,
    /// Answer 500 Internal Server Error.
    Status500,
    /// Answer 416 Range Not Satisfiable.
    Status416,
    /// Answer 206 with a correct `Content-Range` but a body (and `Content-Length`) 10 bytes short.
    ShortBody,
    /// Answer 206 with the body for the right bytes but a `Content-Range` one byte off.
    WrongContentRange,
    /// Send the body in 64-byte pieces, 5 ms apart (slow, but complete).
    Trickle,
    /// Send half the body, then go silent for 2 s and close (longer than the client's idle timeout).
    Stall,
}

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// True for the CDN listener, false for the hub.
    pub cdn: bool,
    /// Request path (without the query).
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// Status code sent.
    pub status: u16,
    /// The fault applied, if any.
    pub fault: Option<Fault>,
}

#[derive(Default)]
struct State {
    faults: VecDeque<Fault>,
    seen: Vec<Seen>,
}

struct Shared {
    root: PathBuf,
    repo: String,
    revision: String,
    cdn_base: String,
    state: Mutex<State>,
    /// When set, every ranged CDN body is trickled 64 bytes per `slow_ms` ms.
    slow_ms: AtomicU64,
    /// Ranged CDN responses whose body was sent completely.
    completed_ranges: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Test server: keep going with whatever a panicked handler left.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running fake hub. Its threads end with the test process.
pub struct FakeHub {
    shared: Arc<Shared>,
    /// `http://127.0.0.1:PORT` of the hub listener (the endpoint to configure).
    pub endpoint: String,
}

impl FakeHub {
    /// Serves `root` as `repo` at `revision`.
    pub fn start(root: &Path, repo: &str, revision: &str) -> std::io::Result<Self> {
        let hub = TcpListener::bind("127.0.0.1:0")?;
        let cdn = TcpListener::bind("127.0.0.1:0")?;
        let shared = Arc::new(Shared {
            root: root.to_path_buf(),
            repo: repo.to_string(),
            revision: revision.to_string(),
            cdn_base: format!("http://127.0.0.1:{}", cdn.local_addr()?.port()),
            state: Mutex::new(State::default()),
            slow_ms: AtomicU64::new(0),
            completed_ranges: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let endpoint = format!("http://127.0.0.1:{}", hub.local_addr()?.port());
        for (listener, is_cdn) in [(hub, false), (cdn, true)] {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || accept_loop(listener, is_cdn, shared));
        }
        Ok(Self { shared, endpoint })
    }

    /// Queues faults; each applies to one upcoming ranged CDN response, in order.
    pub fn inject(&self, faults: &[Fault]) {
        self.shared.lock().faults.extend(faults.iter().copied());
    }

    /// Faults not yet applied.
    pub fn pending_faults(&self) -> usize {
        self.shared.lock().faults.len()
    }

    /// Trickles every ranged CDN body (64 bytes per `ms` milliseconds); 0 turns it off.
    pub fn set_slow(&self, ms: u64) {
        self.shared.slow_ms.store(ms, Ordering::SeqCst);
    }

    /// Ranged CDN responses sent completely so far.
    pub fn completed_ranges(&self) -> u64 {
        self.shared.completed_ranges.load(Ordering::SeqCst)
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.lock().seen.clone()
    }

    /// Forgets the request log.
    pub fn clear_seen(&self) {
        self.shared.lock().seen.clear();
    }

    /// Successful (206) ranged responses so far: one per range request that got its bytes.
    pub fn ranges_served(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.range.is_some() && s.status == 206 && s.fault.is_none())
            .collect()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, is_cdn: bool, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            // A broken connection just ends its thread.
            let _ = serve_connection(conn, is_cdn, &shared);
        });
    }
}

/// Answers requests on one keep-alive connection until the client closes it.
fn serve_connection(conn: TcpStream, is_cdn: bool, shared: &Shared) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
        let (mut range, mut authorization) = (None, None);
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 {
                return Ok(());
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "range" => range = Some(v.trim().to_string()),
                    "authorization" => authorization = Some(v.trim().to_string()),
                    _ => {}
                }
            }
        }
        let path = target.split('?').next().unwrap_or("").to_string();
        let mut seen = Seen {
            cdn: is_cdn,
            path: path.clone(),
            range: range.clone(),
            authorization,
            status: 0,
            fault: None,
        };
        let keep = if method != "GET" {
            seen.status = 405;
            respond(&mut out, 405, &[], b"")?;
            true
        } else if is_cdn {
            serve_cdn(&mut out, shared, &path, range.as_deref(), &mut seen)?
        } else {
            serve_hub(&mut out, shared, &path, range.as_deref(), &mut seen)?
        };
        shared.lock().seen.push(seen);
        if !keep {
            return Ok(());
        }
    }
}

/// The hub: `.safetensors` files redirect to the CDN, others are served here.
fn serve_hub(
    out: &mut TcpStream,
    shared: &Shared,
    path: &str,
    range: Option<&str>,
    seen: &mut Seen,
) -> std::io::Result<bool> {
    let by_name = format!("/{}/resolve/{}/", shared.repo, shared.revision);
    let by_commit = format!("/{}/resolve/{FAKE_COMMIT}/", shared.repo);
    let Some(file) = path
        .strip_prefix(&by_name)
        .or_else(|| path.strip_prefix(&by_commit))
    else {
        seen.status = 404;
        respond(out, 404, &[], b"no such repository or revision")?;
        return Ok(true);
    };
    if file.ends_with(".safetensors") {
        seen.status = 302;
        let location = format!("{}/cdn/{file}?X-Amz-Signature=fake", shared.cdn_base);
        respond(
            out,
            302,
            &[
                ("Location", location),
                ("X-Repo-Commit", FAKE_COMMIT.to_string()),
            ],
            b"",
        )?;
        return Ok(true);
    }
    serve_file(out, shared, file, range, None, seen)
}

/// Headers every hub answer carries.
fn hub_headers() -> Vec<(&'static str, String)> {
    vec![("X-Repo-Commit", FAKE_COMMIT.to_string())]
}

/// The CDN: serves `/cdn/{file}`, applying the next queued fault to ranged requests.
fn serve_cdn(
    out: &mut TcpStream,
    shared: &Shared,
    path: &str,
    range: Option<&str>,
    seen: &mut Seen,
) -> std::io::Result<bool> {
    let Some(file) = path.strip_prefix("/cdn/") else {
        seen.status = 404;
        respond(out, 404, &[], b"")?;
        return Ok(true);
    };
    let fault = if range.is_some() {
        shared.lock().faults.pop_front()
    } else {
        None
    };
    seen.fault = fault;
    serve_file(out, shared, file, range, fault, seen)
}

/// Serves a file of the root, whole or ranged, with `fault` applied.
fn serve_file(
    out: &mut TcpStream,
    shared: &Shared,
    file: &str,
    range: Option<&str>,
    fault: Option<Fault>,
    seen: &mut Seen,
) -> std::io::Result<bool> {
    if file.split('/').any(|c| c == ".." || c.is_empty()) {
        seen.status = 400;
        respond(out, 400, &[], b"")?;
        return Ok(true);
    }
    let Ok(bytes) = std::fs::read(shared.root.join(file)) else {
        seen.status = 404;
        respond(out, 404, &[], b"entry not found")?;
        return Ok(true);
    };
    let total = bytes.len() as u64;
    let Some(range) = range else {
        seen.status = 200;
        // Small files come straight from the hub, which names the commit it served.
        let headers = if seen.cdn { Vec::new() } else { hub_headers() };
        respond(out, 200, &headers, &bytes)?;
        return Ok(true);
    };
    let Some((start, end)) = parse_range(range, total) else {
        seen.status = 416;
        respond(
            out,
            416,
            &[("Content-Range", format!("bytes */{total}"))],
            b"",
        )?;
        return Ok(true);
    };
    let body = &bytes[start as usize..=end as usize];
    let content_range = format!("bytes {start}-{end}/{total}");
    match fault {
        Some(Fault::Status500) => {
            seen.status = 500;
            respond(out, 500, &[], b"internal error")?;
            Ok(true)
        }
        Some(Fault::Status416) => {
            seen.status = 416;
            respond(
                out,
                416,
                &[("Content-Range", format!("bytes */{total}"))],
                b"",
            )?;
            Ok(true)
        }
        Some(Fault::ShortBody) => {
            seen.status = 206;
            let short = &body[..body.len().saturating_sub(10)];
            respond(out, 206, &[("Content-Range", content_range)], short)?;
            Ok(true)
        }
        Some(Fault::WrongContentRange) => {
            seen.status = 206;
            let wrong = format!("bytes {}-{}/{total}", start + 1, end + 1);
            respond(out, 206, &[("Content-Range", wrong)], body)?;
            Ok(true)
        }
        Some(Fault::ResetMidBody) => {
            seen.status = 206;
            head(out, 206, &[("Content-Range", content_range)], body.len())?;
            out.write_all(&body[..body.len() / 2])?;
            out.flush()?;
            reset(out);
            Ok(false)
        }
        Some(Fault::Stall) => {
            seen.status = 206;
            head(out, 206, &[("Content-Range", content_range)], body.len())?;
            out.write_all(&body[..body.len() / 2])?;
            out.flush()?;
            std::thread::sleep(Duration::from_secs(2));
            let _ = out.shutdown(Shutdown::Both);
            Ok(false)
        }
        Some(Fault::Trickle) => {
            seen.status = 206;
            head(out, 206, &[("Content-Range", content_range)], body.len())?;
            trickle(out, body, 5)?;
            shared.completed_ranges.fetch_add(1, Ordering::SeqCst);
            Ok(true)
        }
        None => {
            seen.status = 206;
            let slow = shared.slow_ms.load(Ordering::SeqCst);
            head(out, 206, &[("Content-Range", content_range)], body.len())?;
            if slow > 0 {
                trickle(out, body, slow)?;
            } else {
                out.write_all(body)?;
                out.flush()?;
            }
            shared.completed_ranges.fetch_add(1, Ordering::SeqCst);
            Ok(true)
        }
    }
}

fn trickle(out: &mut TcpStream, body: &[u8], ms: u64) -> std::io::Result<()> {
    for piece in body.chunks(64) {
        out.write_all(piece)?;
        out.flush()?;
        std::thread::sleep(Duration::from_millis(ms));
    }
    Ok(())
}

/// Closes with RST instead of FIN (SO_LINGER with a zero timeout).
fn reset(out: &TcpStream) {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt on a socket we own, with a pointer to a live linger struct and its size.
        unsafe {
            libc::setsockopt(
                out.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
    }
    let _ = out.shutdown(Shutdown::Both);
}

/// `bytes=a-b` or `bytes=a-` within a file of `total` bytes.
fn parse_range(v: &str, total: u64) -> Option<(u64, u64)> {
    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
    let a: u64 = a.parse().ok()?;
    let b: u64 = if b.is_empty() {
        total.checked_sub(1)?
    } else {
        b.parse().ok()?
    };
    (a <= b && b < total).then_some((a, b.min(total - 1)))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        416 => "Range Not Satisfiable",
        _ => "Internal Server Error",
    }
}

fn head(
    out: &mut TcpStream,
    status: u16,
    headers: &[(&str, String)],
    len: usize,
) -> std::io::Result<()> {
    let mut text = format!(
        "HTTP/1.1 {status} {}\r\nContent-Length: {len}\r\n",
        reason(status)
    );
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("\r\n");
    out.write_all(text.as_bytes())
}

fn respond(
    out: &mut TcpStream,
    status: u16,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    head(out, status, headers, body.len())?;
    out.write_all(body)?;
    out.flush()
}

/// Reads a whole stream (helper for tests that spawn children).
pub fn read_all(mut r: impl Read) -> String {
    let mut s = String::new();
    let _ = r.read_to_string(&mut s);
    s
}
