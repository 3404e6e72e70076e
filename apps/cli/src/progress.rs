//! The prefill progress bar of `deltafin run`: shown on a terminal once a prompt has taken a couple of seconds, with
//! tokens and layers done and an estimate of the time left; nothing when stderr is not a terminal.

use std::cell::RefCell;
use std::io::IsTerminal;
use std::time::Duration;

use deltafin_runtime::{PrefillProgress, ProgressFn};
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
