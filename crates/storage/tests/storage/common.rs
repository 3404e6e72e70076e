//! Test harness: locate fixtures, copy one into a temporary directory, and break the copy on purpose
//! by rewriting shard headers, the index, or raw bytes.

use std::fs;
use std::path::{Path, PathBuf};

use deltafin_storage::{ExpertMap, ModelFiles, StorageError};
use serde_json::{Map, Value};
use tempfile::TempDir;

/// K3 fixture with 7 shards, 16 MXFP4 experts per MoE layer.
pub const K3_A: &str = "k3/k3-tiny-a";
/// K3 fixture with 10 shards, 32 MXFP4 experts per MoE layer.
pub const K3_B: &str = "k3/k3-tiny-b";
/// Kimi Linear fixture: one `model.safetensors`, dense F32 experts.
pub const KL_QLORA: &str = "kimi-linear/qlora";
/// Kimi Linear fixture without the q LoRA.
pub const KL_NOQLORA: &str = "kimi-linear/noqlora";

/// Index file name in sharded fixtures.
pub const INDEX: &str = "model.safetensors.index.json";

/// A fixture directory in the repository (never `/work/shared`).
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

/// A writable copy of a fixture's checkpoint files.
pub struct Broken {
    dir: TempDir,
}

impl Broken {
    /// Copies the index and model shards (not goldens or tokenizers) of fixture `rel`.
    pub fn copy(rel: &str) -> Self {
        let dir = TempDir::new().expect("create temp dir");
        for entry in fs::read_dir(fixture(rel)).expect("read fixture dir") {
            let entry = entry.expect("read fixture dir entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            let wanted =
                name == INDEX || (name.starts_with("model") && name.ends_with(".safetensors"));
            if wanted {
                fs::copy(entry.path(), dir.path().join(&name)).expect("copy fixture file");
            }
        }
        Broken { dir }
    }

    /// The copy's directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A file inside the copy.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn has_index(&self) -> bool {
        self.file(INDEX).is_file()
    }

    /// The shard file holding `tensor`, per the index (or the single file).
    pub fn shard_of(&self, tensor: &str) -> String {
        if !self.has_index() {
            return "model.safetensors".to_string();
        }
        let index = self.index();
        index["weight_map"][tensor]
            .as_str()
            .unwrap_or_else(|| panic!("{tensor} not in the fixture index"))
            .to_string()
    }

    /// The parsed index.
    pub fn index(&self) -> Value {
        let bytes = fs::read(self.file(INDEX)).expect("read index");
        serde_json::from_slice(&bytes).expect("fixture index is json")
    }

    /// Rewrites the index through `edit`.
    pub fn edit_index(&self, edit: impl FnOnce(&mut Value)) {
        let mut index = self.index();
        edit(&mut index);
        fs::write(
            self.file(INDEX),
            serde_json::to_vec(&index).expect("serialize index"),
        )
        .expect("write index");
    }

    /// Rewrites the header of `shard` through `edit`, keeping the data bytes unchanged (offsets are
    /// relative to the end of the header, so they stay valid whatever the new header length).
    pub fn edit_header(&self, shard: &str, edit: impl FnOnce(&mut Map<String, Value>)) {
        let path = self.file(shard);
        let bytes = fs::read(&path).expect("read shard");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8-byte prefix")) as usize;
        let mut header: Map<String, Value> =
            serde_json::from_slice(&bytes[8..8 + n]).expect("fixture header is json");
        edit(&mut header);
        let json = serde_json::to_vec(&header).expect("serialize header");
        self.write_shard(shard, &json, &bytes[8 + n..]);
    }

    /// Writes `shard` as prefix + `header` bytes (verbatim) + `data`.
    pub fn write_shard(&self, shard: &str, header: &[u8], data: &[u8]) {
        let mut out = Vec::with_capacity(8 + header.len() + data.len());
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(header);
        out.extend_from_slice(data);
        fs::write(self.file(shard), out).expect("write shard");
    }

    /// The data bytes of `shard` (everything after the header).
    pub fn data_of(&self, shard: &str) -> Vec<u8> {
        let bytes = fs::read(self.file(shard)).expect("read shard");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8-byte prefix")) as usize;
        bytes[8 + n..].to_vec()
    }

    /// Edits one tensor's header entry in place.
    pub fn edit_entry(&self, tensor: &str, edit: impl FnOnce(&mut Map<String, Value>)) {
        self.edit_header(&self.shard_of(tensor), |h| {
            let entry = h
                .get_mut(tensor)
                .and_then(Value::as_object_mut)
                .unwrap_or_else(|| panic!("{tensor} not in its shard header"));
            edit(entry);
        });
    }

    /// Sets one field of a tensor's header entry.
    pub fn set_field(&self, tensor: &str, field: &str, value: Value) {
        self.edit_entry(tensor, |e| {
            e.insert(field.to_string(), value);
        });
    }

    /// The parsed header of `shard`, read only.
    pub fn header(&self, shard: &str) -> Map<String, Value> {
        let bytes = fs::read(self.file(shard)).expect("read shard");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8-byte prefix")) as usize;
        serde_json::from_slice(&bytes[8..8 + n]).expect("header is json")
    }

    /// A tensor's `data_offsets` as written, as `(begin, end)`.
    pub fn offsets(&self, tensor: &str) -> (u64, u64) {
        let header = self.header(&self.shard_of(tensor));
        let pair = &header[tensor]["data_offsets"];
        let get = |i: usize| pair[i].as_u64().expect("offset is an integer");
        (get(0), get(1))
    }

    /// Exchanges the `data_offsets` of two tensors of the same shard (and length, to stay valid).
    pub fn swap_offsets(&self, a: &str, b: &str) {
        assert_eq!(self.shard_of(a), self.shard_of(b), "swap within one shard");
        self.edit_header(&self.shard_of(a), |h| {
            let oa = h[a]["data_offsets"].clone();
            let ob = h[b]["data_offsets"].clone();
            h[a]["data_offsets"] = ob;
            h[b]["data_offsets"] = oa;
        });
    }

    /// Removes a tensor from its shard header and from the index.
    pub fn remove_tensor(&self, tensor: &str) {
        let shard = self.shard_of(tensor);
        self.edit_header(&shard, |h| {
            h.remove(tensor).expect("tensor in header");
        });
        if self.has_index() {
            self.edit_index(|i| {
                i["weight_map"]
                    .as_object_mut()
                    .expect("weight_map object")
                    .remove(tensor)
                    .expect("tensor in index");
            });
        }
    }

    /// Renames a tensor in its shard header and in the index.
    pub fn rename_tensor(&self, old: &str, new: &str) {
        let shard = self.shard_of(old);
        self.edit_header(&shard, |h| {
            let entry = h.remove(old).expect("tensor in header");
            h.insert(new.to_string(), entry);
        });
        if self.has_index() {
            self.edit_index(|i| {
                let map = i["weight_map"].as_object_mut().expect("weight_map object");
                let v = map.remove(old).expect("tensor in index");
                map.insert(new.to_string(), v);
            });
        }
    }

    /// Opens the copy, expecting success.
    pub fn open(&self) -> ModelFiles {
        ModelFiles::open(self.path()).unwrap_or_else(|e| panic!("open failed: {e}"))
    }

    /// Opens the copy, expecting failure.
    pub fn open_err(&self) -> StorageError {
        match ModelFiles::open(self.path()) {
            Ok(_) => panic!("open of a broken copy succeeded"),
            Err(e) => e,
        }
    }

    /// Opens the copy (which must succeed) and builds the expert map, expecting failure.
    pub fn experts_err(&self) -> StorageError {
        match ExpertMap::build(&self.open()) {
            Ok(_) => panic!("expert map of a broken copy built"),
            Err(e) => e,
        }
    }
}

/// Asserts that the error's message names every one of `needles` (file names, tensors, numbers).
/// With `SHOW_ERRORS` set, also prints it (run with `--nocapture` to review the wording).
pub fn assert_names(err: &StorageError, needles: &[&str]) {
    let msg = err.to_string();
    if std::env::var_os("SHOW_ERRORS").is_some() {
        eprintln!("\nERR: {msg}");
    }
    for needle in needles {
        assert!(
            msg.contains(needle),
            "message {msg:?} does not name {needle:?}"
        );
    }
}

/// K3 expert tensor name.
pub fn k3_expert(layer: usize, expert: usize, part: &str) -> String {
    format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}")
}

/// Kimi Linear expert tensor name.
pub fn kl_expert(layer: usize, expert: usize, part: &str) -> String {
    format!("model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}")
}
