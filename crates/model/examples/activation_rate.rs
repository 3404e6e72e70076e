//! The GLU activation's cost per value on one thread: the vectorised path (`deltafin_model::activation`) against
//! its plain twin (`deltafin_model::ops::glu`, libm's `tanh` and `exp`), on K3's SiTU, with the largest relative
//! difference between the two.
//!
//! `cargo run --release -p deltafin-model --example activation_rate [-- VALUES]` (default 25,000,000: one MoE layer
//! of a 512-token K3 prompt, 512 × 16 × 3072).

use std::time::Instant;

use deltafin_model::activation::glu_in_place;
use deltafin_model::config::Activation;
use deltafin_model::ops::glu;

fn main() {
    let n: usize = match std::env::args().nth(1).map(|v| v.parse()) {
        None => 25_000_000,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("the argument is a count of values, e.g. 25000000");
            std::process::exit(2);
        }
    };
    let act = Activation::Situ {
        beta: 4.0,
        linear_beta: 25.0,
    };
    let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).sin() * 3.0).collect();
    let mut fast = gate.clone();
    let started = Instant::now();
    glu_in_place(act, &mut fast, &up);
    let fast_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let plain: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| glu(act, g, u))
        .collect();
    let plain_s = started.elapsed().as_secs_f64();
    let worst = fast
        .iter()
        .zip(&plain)
        .filter(|(_, p)| p.abs() > 1e-20)
        .map(|(f, p)| ((f - p) / p).abs())
        .fold(0.0f32, f32::max);
    println!(
        "{n} SiTU values, one thread: vectorised {:.2} ns a value, libm twin {:.2} ns; largest relative difference {worst:.2e}",
        fast_s / n as f64 * 1e9,
        plain_s / n as f64 * 1e9,
    );
}
