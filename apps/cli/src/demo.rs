//! The embedded demo model: a tiny K3-architecture checkpoint with random weights (the `k3-tiny-a` fixture),
//! written to disk on first use so `deltafin run` works on a fresh machine with no model installed.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Marker file that identifies a materialised demo model.
const MARKER: &str = "DELTAFIN_DEMO_MODEL";

/// The files of the demo model, embedded at build time.
const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/config.json"),
    ),
    (
        "model.safetensors.index.json",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model.safetensors.index.json"),
    ),
    (
        "model-00001-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00001-of-000007.safetensors"),
    ),
    (
        "model-00002-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00002-of-000007.safetensors"),
    ),
    (
        "model-00003-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00003-of-000007.safetensors"),
    ),
    (
        "model-00004-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00004-of-000007.safetensors"),
    ),
    (
        "model-00005-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00005-of-000007.safetensors"),
    ),
    (
        "model-00006-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00006-of-000007.safetensors"),
    ),
    (
        "model-00007-of-000007.safetensors",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/model-00007-of-000007.safetensors"),
    ),
    (
        "tiktoken.model",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/tiktoken.model"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../tests/fixtures/k3/k3-tiny-a/tokenizer_config.json"),
    ),
];

/// A fixed prompt for the demo model (its first id is the demo's BOS).
pub const DEMO_PROMPT_IDS: &[u32] = &[556, 710, 458, 223, 499, 743, 491, 282];

/// The installed K3 under the root if there is one, else the demo model (materialised on first use).
pub fn default_model_dir() -> anyhow::Result<PathBuf> {
    let root = crate::paths::root_dir();
    let installed = root.join("models").join("Kimi-K3");
    if installed.join("config.json").is_file() {
        return Ok(installed);
    }
    let demo = root.join("demo");
    materialise(&demo)?;
    eprintln!(
        "note: no model installed under {}; using the embedded demo model (tiny K3 architecture, random \
         weights: its output is noise) at {}",
        installed.display(),
        demo.display()
    );
    Ok(demo)
}

/// Whether `dir` holds the demo model.
pub fn is_demo(dir: &Path) -> bool {
    dir.join(MARKER).is_file()
}

/// Writes the demo files into `dir` unless they are already there, each atomically (temp file + rename).
fn materialise(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|existing| existing == *bytes) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    }
    std::fs::write(dir.join(MARKER), b"embedded demo model\n")
        .with_context(|| format!("writing marker in {}", dir.display()))?;
    Ok(())
}
