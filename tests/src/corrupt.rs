//! Builders of broken checkpoints for the bad-input tests: a fixture copied into a temporary directory, then
//! damaged in one specific way.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;

/// A fixture copied into a fresh temporary directory.
pub struct ScratchModel {
    /// Keeps the directory alive.
    _tmp: tempfile::TempDir,
    /// The copy.
    pub dir: PathBuf,
}

impl ScratchModel {
    /// Copies every file of `src` (not recursive).
    pub fn copy_of(src: &Path) -> anyhow::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("model");
        std::fs::create_dir(&dir)?;
        for entry in std::fs::read_dir(src)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
            }
        }
        Ok(Self { _tmp: tmp, dir })
    }

    /// Path of `name` inside the copy.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Reads a shard's header as JSON and its data section.
    pub fn read_shard(&self, name: &str) -> anyhow::Result<(Value, Vec<u8>)> {
        let bytes = std::fs::read(self.path(name))?;
        let n = u64::from_le_bytes(bytes[..8].try_into().context("length prefix")?) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n])?;
        Ok((header, bytes[8 + n..].to_vec()))
    }

    /// Writes a shard from a header and a data section.
    pub fn write_shard(&self, name: &str, header: &Value, data: &[u8]) -> anyhow::Result<()> {
        let json = serde_json::to_vec(header)?;
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out.extend_from_slice(data);
        std::fs::write(self.path(name), out)?;
        Ok(())
    }

    /// The shard (file name) that holds `tensor`, from the index.
    pub fn shard_of(&self, tensor: &str) -> anyhow::Result<String> {
        let index: Value =
            serde_json::from_slice(&std::fs::read(self.path("model.safetensors.index.json"))?)?;
        match index["weight_map"][tensor].as_str() {
            Some(s) => Ok(s.to_string()),
            None => bail!("{tensor} is not in the index"),
        }
    }

    /// Edits `config.json` in place.
    pub fn edit_config(&self, edit: impl FnOnce(&mut Value)) -> anyhow::Result<()> {
        let path = self.path("config.json");
        let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        edit(&mut cfg);
        std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)?;
        Ok(())
    }
}
