//! What the attention rate examples (`kda_rate`, `mla_rate`) share: their arguments, the engine's allocator
//! settings, the FMA peak read before and after (the best of three probes each time, the faster used), the median of
//! five timed passes after a warm-up, and one JSON line per part timed and token count.

/// Timed passes per token count.
const PASSES: usize = 5;

/// A rate run: the token counts and heads asked for, and the FMA peak read before any pass.
pub struct Rate {
    pub tokens: Vec<usize>,
    pub heads: usize,
    peak_before: f64,
    /// (part, tokens, median seconds).
    results: Vec<(&'static str, usize, f64)>,
}

impl Rate {
    /// Reads `--tokens a,b,…` and `--heads N` (defaults `tokens`, 96; exits with a usage line on anything else), sets
    /// the engine's allocator settings (its buffers reused, not mapped afresh each call) and reads the FMA peak.
    pub fn from_args(example: &str, tokens: &[usize]) -> Rate {
        let mut rate = Rate {
            tokens: tokens.to_vec(),
            heads: 96,
            peak_before: 0.0,
            results: Vec::new(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let value = args.next().unwrap_or_default();
            let parsed = match a.as_str() {
                "--tokens" => value
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().map_err(|e| format!("{s:?}: {e}")))
                    .collect::<Result<Vec<_>, _>>()
                    .map(|v| rate.tokens = v),
                "--heads" => value
                    .parse()
                    .map(|h| rate.heads = h)
                    .map_err(|e| format!("{value:?}: {e}")),
                other => Err(format!("unknown argument {other}")),
            };
            if let Err(e) = parsed {
                eprintln!("{e}; usage: {example} [--tokens 64,512] [--heads 96]");
                std::process::exit(2);
            }
        }
        deltafin_quant::allocator::keep_freed_memory();
        rate.peak_before = deltafin_quant::flops::best_fma_peak(3, 20_000_000);
        rate
    }

    /// Times `pass` (returning its seconds) once to warm up, then [`PASSES`] times, and keeps the median as `part`'s
    /// for `t_len` tokens.
    pub fn time(&mut self, part: &'static str, t_len: usize, mut pass: impl FnMut() -> f64) {
        pass();
        let mut secs: Vec<f64> = (0..PASSES).map(|_| pass()).collect();
        secs.sort_by(f64::total_cmp);
        self.results.push((part, t_len, secs[PASSES / 2]));
    }

    /// Reads the FMA peak again and prints it, then one JSON line per part and token count with `flops(t_len)` (the
    /// whole layer's) against the faster of the two peak readings.
    pub fn report(self, flops: impl Fn(usize) -> f64) {
        let peak_after = deltafin_quant::flops::best_fma_peak(3, 20_000_000);
        let peak = self.peak_before.max(peak_after);
        println!(
            "threads {}, FMA peak {:.0} / {:.0} GFLOP/s (before / after)",
            rayon::current_num_threads(),
            self.peak_before / 1e9,
            peak_after / 1e9
        );
        for (part, t_len, s) in self.results {
            let f = flops(t_len);
            println!(
                "{{\"part\":\"{part}\",\"tokens\":{t_len},\"heads\":{},\"ms\":{:.3},\"gflop_s\":{:.1},\"of_peak\":{:.3}}}",
                self.heads,
                s * 1e3,
                f / s / 1e9,
                f / s / peak
            );
        }
    }
}
