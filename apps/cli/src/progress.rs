//! Progress bars on stderr, shown only on a terminal: the prefill bar of `deltafin run` (once a prompt has taken a
//! couple of seconds, with tokens and layers done and an estimate of the time left), and the byte bars of `setup`
//! and of opening a model (storage and the engine report through storage's [`Progress`] trait).

use std::cell::RefCell;
use std::io::IsTerminal;
use std::time::Duration;

use deltafin_runtime::{PrefillProgress, ProgressFn};
use deltafin_storage::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A prefill shorter than this shows no bar.
const SHOW_AFTER: Duration = Duration::from_secs(2);

/// Steps of the bar: thousandths of the prefill's work.
const STEPS: u64 = 1000;

/// The bar for `deltafin run`'s prefill: a callback for `Session::set_progress` where stderr is a terminal.
pub fn prefill_bar<'e>() -> Option<ProgressFn<'e>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar: RefCell<Option<ProgressBar>> = RefCell::new(None);
    Some(Box::new(move |p: &PrefillProgress| {
        let mut bar = bar.borrow_mut();
        if bar.is_none() && p.elapsed >= SHOW_AFTER && p.fraction() < 1.0 {
            let b = ProgressBar::with_draw_target(Some(STEPS), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template("prefill [{bar:30}] {msg} (ETA {eta})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            *bar = Some(b);
        }
        if let Some(b) = bar.as_ref() {
            b.set_position((p.fraction() * STEPS as f64) as u64);
            b.set_message(format!(
                "{}/{} tokens, layer {}/{} of a {}-token pass",
                p.tokens_done, p.tokens_total, p.layers_done, p.layers, p.pass_tokens
            ));
            if p.tokens_done + p.pass_tokens >= p.tokens_total && p.layers_done == p.layers {
                b.finish_and_clear();
            }
        }
    }))
}

/// The byte bar of opening a model (the spine read, and uploaded on a GPU), where stderr is a terminal.
pub fn open_bar() -> Option<std::sync::Arc<dyn Progress + Send>> {
    std::io::stderr()
        .is_terminal()
        .then(|| std::sync::Arc::new(BarProgress::default()) as std::sync::Arc<dyn Progress + Send>)
}

/// Byte progress bars for installs (bytes, rate, ETA); hidden when stderr is not a terminal.
#[derive(Debug, Default)]
pub struct BarProgress {
    bar: std::sync::Mutex<Option<ProgressBar>>,
}

impl BarProgress {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<ProgressBar>> {
        // A bar is plain display state; a panic elsewhere leaves it usable.
        self.bar.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Progress for BarProgress {
    fn start(&self, label: &str, total: u64) {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        // The template is a constant known to parse; fall back to the default style if it did not.
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:>8} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(label.to_string());
        bar.enable_steady_tick(Duration::from_millis(250));
        *self.lock() = Some(bar);
    }

    fn advance(&self, bytes: u64) {
        if let Some(bar) = self.lock().as_ref() {
            bar.inc(bytes);
        }
    }

    fn finish(&self) {
        if let Some(bar) = self.lock().take() {
            bar.finish();
        }
    }
}
