//! Counters for `GET /metrics`, written in Prometheus' text exposition format (version 0.0.4).
//!
//! The HTTP side counts requests and refusals; the engine thread adds each generation's tokens and times and
//! copies the engine's own cumulative counters (expert cache, bytes read, speculation) after every token, so a
//! scrape during a long generation is current. Everything is a relaxed atomic: a scrape may see one generation
//! half counted, never a torn number.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// The engine's cumulative counters, as the engine thread last read them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineCounters {
    /// RAM expert cache hits.
    pub expert_cache_hits: u64,
    /// RAM expert cache misses.
    pub expert_cache_misses: u64,
    /// Expert bytes read from disk.
    pub expert_bytes_read: u64,
    /// Spine bytes read from disk by forward passes (streamed layers).
    pub spine_bytes_read: u64,
    /// Draft tokens proposed by n-gram speculation.
    pub spec_drafted: u64,
    /// Draft tokens accepted.
    pub spec_accepted: u64,
}

/// Every counter the server exports.
#[derive(Debug, Default)]
pub struct Metrics {
    chat_requests: AtomicU64,
    completion_requests: AtomicU64,
    rejected_queue_full: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
    constrained_requests: AtomicU64,
    mask_ns: AtomicU64,
    expert_cache_hits: AtomicU64,
    expert_cache_misses: AtomicU64,
    expert_bytes_read: AtomicU64,
    spine_bytes_read: AtomicU64,
    spec_drafted: AtomicU64,
    spec_accepted: AtomicU64,
}

/// The endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// What one finished generation adds.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct GenerationCounts {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens reused from the session.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Seconds from the start of the job to its first token (feeding the prompt).
    pub prefill_secs: f64,
    /// Seconds from the first token to the last.
    pub decode_secs: f64,
    /// Seconds spent computing token masks.
    pub mask_secs: f64,
    /// Whether a grammar constrained it.
    pub constrained: bool,
    /// Whether it was cancelled (client gone, shutdown).
    pub cancelled: bool,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn nanos(secs: f64) -> u64 {
    (secs.max(0.0) * 1e9) as u64
}

impl Metrics {
    /// A request reached the queue.
    pub fn request(&self, kind: RequestKind) {
        match kind {
            RequestKind::Chat => add(&self.chat_requests, 1),
            RequestKind::Completion => add(&self.completion_requests, 1),
        }
    }

    /// A request found the queue full (429).
    pub fn rejected(&self) {
        add(&self.rejected_queue_full, 1);
    }

    /// A generation failed in the engine.
    pub fn failed(&self) {
        add(&self.failed, 1);
    }

    /// A generation ended.
    pub fn generation(&self, c: &GenerationCounts) {
        add(&self.prompt_tokens, c.prompt_tokens);
        add(&self.cached_prompt_tokens, c.cached_tokens);
        add(&self.generated_tokens, c.generated_tokens);
        add(&self.prefill_ns, nanos(c.prefill_secs));
        add(&self.decode_ns, nanos(c.decode_secs));
        add(&self.mask_ns, nanos(c.mask_secs));
        add(&self.constrained_requests, u64::from(c.constrained));
        add(&self.cancelled, u64::from(c.cancelled));
    }

    /// Copies the engine's cumulative counters.
    pub fn set_engine(&self, e: &EngineCounters) {
        self.set_reads(e);
        self.spec_drafted.store(e.spec_drafted, Ordering::Relaxed);
        self.spec_accepted.store(e.spec_accepted, Ordering::Relaxed);
    }

    /// Copies the engine's expert cache and read counters of `e` (not speculation, which the session counts).
    pub fn set_reads(&self, e: &EngineCounters) {
        let set = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&self.expert_cache_hits, e.expert_cache_hits);
        set(&self.expert_cache_misses, e.expert_cache_misses);
        set(&self.expert_bytes_read, e.expert_bytes_read);
        set(&self.spine_bytes_read, e.spine_bytes_read);
    }

    /// The exposition text; `waiting` and `running` are the queue's state now.
    pub fn render(&self, model: &str, waiting: usize, running: bool) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let secs = |a: &AtomicU64| get(a) as f64 / 1e9;
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in samples {
                if labels.is_empty() {
                    let _ = writeln!(out, "{name} {value}");
                } else {
                    let _ = writeln!(out, "{name}{{{labels}}} {value}");
                }
            }
        };
        let n = |v: u64| v.to_string();
        let model_label = format!("model=\"{}\"", escape_label(model));
        metric(
            "deltafin_info",
            "gauge",
            "The served model.",
            &[(&model_label, n(1))],
        );
        metric(
            "deltafin_requests_total",
            "counter",
            "Generation requests accepted into the queue, by endpoint.",
            &[
                ("endpoint=\"chat\"", n(get(&self.chat_requests))),
                (
                    "endpoint=\"completions\"",
                    n(get(&self.completion_requests)),
                ),
            ],
        );
        metric(
            "deltafin_requests_rejected_total",
            "counter",
            "Requests answered 429 because the queue was full.",
            &[("", n(get(&self.rejected_queue_full)))],
        );
        metric(
            "deltafin_requests_failed_total",
            "counter",
            "Generations that failed in the engine.",
            &[("", n(get(&self.failed)))],
        );
        metric(
            "deltafin_requests_cancelled_total",
            "counter",
            "Generations stopped because the client went away or the server shut down.",
            &[("", n(get(&self.cancelled)))],
        );
        metric(
            "deltafin_requests_constrained_total",
            "counter",
            "Generations constrained by a grammar (JSON response format, tool schemas).",
            &[("", n(get(&self.constrained_requests)))],
        );
        metric(
            "deltafin_queue_waiting",
            "gauge",
            "Requests waiting for the engine.",
            &[("", n(waiting as u64))],
        );
        metric(
            "deltafin_generating",
            "gauge",
            "1 while a generation holds the engine.",
            &[("", n(u64::from(running)))],
        );
        metric(
            "deltafin_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished generations.",
            &[("", n(get(&self.prompt_tokens)))],
        );
        metric(
            "deltafin_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the session instead of being fed again.",
            &[("", n(get(&self.cached_prompt_tokens)))],
        );
        metric(
            "deltafin_generated_tokens_total",
            "counter",
            "Tokens generated.",
            &[("", n(get(&self.generated_tokens)))],
        );
        metric(
            "deltafin_prefill_seconds_total",
            "counter",
            "Time from the start of a generation to its first token (feeding the prompt).",
            &[("", secs(&self.prefill_ns).to_string())],
        );
        metric(
            "deltafin_decode_seconds_total",
            "counter",
            "Time from the first token of a generation to its last.",
            &[("", secs(&self.decode_ns).to_string())],
        );
        metric(
            "deltafin_mask_seconds_total",
            "counter",
            "Time spent computing grammar token masks.",
            &[("", secs(&self.mask_ns).to_string())],
        );
        metric(
            "deltafin_expert_cache_hits_total",
            "counter",
            "Routed experts found in the RAM expert cache.",
            &[("", n(get(&self.expert_cache_hits)))],
        );
        metric(
            "deltafin_expert_cache_misses_total",
            "counter",
            "Routed experts not in the RAM expert cache (read from disk or the network).",
            &[("", n(get(&self.expert_cache_misses)))],
        );
        metric(
            "deltafin_read_bytes_total",
            "counter",
            "Bytes read from disk by forward passes, by what was read.",
            &[
                ("kind=\"experts\"", n(get(&self.expert_bytes_read))),
                ("kind=\"spine\"", n(get(&self.spine_bytes_read))),
            ],
        );
        metric(
            "deltafin_speculation_drafted_total",
            "counter",
            "Draft tokens proposed by n-gram speculation.",
            &[("", n(get(&self.spec_drafted)))],
        );
        metric(
            "deltafin_speculation_accepted_total",
            "counter",
            "Draft tokens accepted (each saves a forward pass).",
            &[("", n(get(&self.spec_accepted)))],
        );
        out
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_help_type_and_values() {
        let m = Metrics::default();
        m.request(RequestKind::Chat);
        m.rejected();
        m.generation(&GenerationCounts {
            prompt_tokens: 10,
            generated_tokens: 4,
            prefill_secs: 0.5,
            decode_secs: 1.25,
            ..Default::default()
        });
        m.set_engine(&EngineCounters {
            expert_cache_hits: 7,
            expert_bytes_read: 4096,
            ..Default::default()
        });
        let text = m.render("k3 \"x\"", 2, true);
        for line in [
            "deltafin_info{model=\"k3 \\\"x\\\"\"} 1",
            "deltafin_requests_total{endpoint=\"chat\"} 1",
            "deltafin_requests_rejected_total 1",
            "deltafin_queue_waiting 2",
            "deltafin_generating 1",
            "deltafin_generated_tokens_total 4",
            "deltafin_prefill_seconds_total 0.5",
            "deltafin_decode_seconds_total 1.25",
            "deltafin_expert_cache_hits_total 7",
            "deltafin_read_bytes_total{kind=\"experts\"} 4096",
            "# TYPE deltafin_generated_tokens_total counter",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Every sample line is `name[{labels}] number`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let value = l.rsplit(' ').next().expect("value");
            assert!(value.parse::<f64>().is_ok(), "{l}");
        }
    }
}
