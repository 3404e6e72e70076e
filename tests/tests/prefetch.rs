//! Look-ahead expert prefetch (`K3_PREFETCH`): guesses of the next MoE layer's experts are read from disk into the
//! cache ahead of time. Results are bit-identical to decoding without it, every prefetch read is accounted for as
//! used or wasted, the recall is reported, and a guessed expert is never read twice.

use std::path::Path;

use deltafin_runtime::{Engine, EngineOptions, GenerateOptions, PinLayers, PrefetchStats};
use deltafin_tests::{Golden, fixture};

/// The K3 fixtures (several MoE layers each).
const FIXTURES: [&str; 2] = ["k3/k3-tiny-a", "k3/k3-tiny-b"];

fn open(dir: &Path, prefetch: bool, ram_gb: f64) -> Engine {
    let options = EngineOptions {
        ram_gb: Some(ram_gb),
        ..EngineOptions::default()
    }
    .with_prefetch(prefetch)
    // Guesses need the next layer's router in memory: keep the spine resident whatever the budget.
    .with_pin_layers(PinLayers::All);
    Engine::open(dir, options).expect("open")
}

/// Step-by-step logits and greedy tokens for the fixture's prompt.
fn outputs(engine: &Engine, ids: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut s = engine.session();
    let steps = ids.iter().map(|&id| s.step(id).expect("step")).collect();
    let greedy = engine
        .session()
        .generate(
            &ids[..ids.len().min(6)],
            &GenerateOptions {
                max_new: 12,
                ignore_eos: true,
                ..Default::default()
            },
            |_| true,
        )
        .expect("generate")
        .tokens;
    (steps, greedy)
}

#[test]
fn prefetch_is_bit_identical_and_accounts_for_every_read() {
    for name in FIXTURES {
        let dir = fixture(name);
        let ids = Golden::load(&dir)
            .expect("golden")
            .ids("input_ids")
            .expect("ids");
        // A cache far smaller than the experts, so most experts come from disk in both runs.
        let budget = 0.0005;
        let plain = open(&dir, false, budget);
        let expected = outputs(&plain, &ids);
        assert_eq!(
            plain.expert_stats().prefetch,
            None,
            "off means no prefetcher"
        );

        let engine = open(&dir, true, budget);
        assert_eq!(
            outputs(&engine, &ids),
            expected,
            "{name}: prefetch changed the results"
        );
        let stats = engine.expert_stats();
        let p: PrefetchStats = stats.prefetch.expect("prefetch on");
        assert!(p.guesses > 0, "{name}: no guess was made: {p:?}");
        assert!(p.reads > 0, "{name}: no prefetch read: {p:?}");
        assert!(p.recalled <= p.wanted && p.wanted > 0, "{name}: {p:?}");
        assert!((0.0..=1.0).contains(&p.recall()));
        // Every read is used or wasted, except those of the last guess (its layer never came).
        assert!(
            p.used + p.wasted <= p.reads && p.reads - (p.used + p.wasted) <= p.guessed,
            "{name}: {p:?}"
        );
        // Guessed experts are never read twice: every cache miss is served by exactly one read, the prefetcher's
        // (used) or the layer's own, so disk reads = misses - used + prefetch reads.
        assert_eq!(
            stats.reader.disk.reads,
            stats.cache.misses - p.used + p.reads,
            "{name}: {stats:?}"
        );
    }
}
