//! Session snapshots on disk: versioned, checksummed and written atomically, so a long system prompt is paid once
//! per machine.
//!
//! Layout (little-endian): magic `DFSNAP01`, version `u32`, model fingerprint `u32`, CRC-32 of the body `u32`,
//! body length `u64`, body. The body holds the token ids, the pending count and every layer's state (KDA conv
//! windows and recurrent state; MLA latent rows).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use deltafin_model::state::{KdaState, LayerState, MlaCache};
use deltafin_model::{AttnKind, ModelConfig, SessionState};

use crate::error::{Result, RuntimeError};
use crate::session::Snapshot;

const MAGIC: &[u8; 8] = b"DFSNAP01";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 4 + 4 + 8;

fn bad(path: &Path, msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Snapshot {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Writes `snap` to `path` (temp file, fsync, rename).
pub fn save(path: &Path, snap: &Snapshot, fingerprint: u32) -> Result<()> {
    let mut body = Vec::new();
    body.extend_from_slice(&(snap.tokens.len() as u64).to_le_bytes());
    body.extend_from_slice(&(snap.pending as u64).to_le_bytes());
    for t in &snap.tokens {
        body.extend_from_slice(&t.to_le_bytes());
    }
    body.extend_from_slice(&(snap.state.n_tokens as u64).to_le_bytes());
    body.extend_from_slice(&(snap.state.layers.len() as u32).to_le_bytes());
    for layer in &snap.state.layers {
        match layer {
            LayerState::Kda(k) => {
                body.push(0);
                for c in k.conv()? {
                    put_f32s(&mut body, c);
                }
                put_f32s(&mut body, k.s()?);
            }
            LayerState::Mla(m) => {
                body.push(1);
                body.extend_from_slice(&(m.row_width() as u64).to_le_bytes());
                let rows: Vec<f32> = m.rows().flatten().copied().collect();
                put_f32s(&mut body, &rows);
            }
        }
    }
    let mut file = Vec::with_capacity(HEADER_LEN + body.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&VERSION.to_le_bytes());
    file.extend_from_slice(&fingerprint.to_le_bytes());
    file.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    file.extend_from_slice(&(body.len() as u64).to_le_bytes());
    file.extend_from_slice(&body);
    let io = |e: std::io::Error| bad(path, format!("cannot write: {e}"));
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&file).map_err(io)?;
    f.sync_all().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io)
}

/// A cursor over the body that fails instead of reading past the end.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.buf.len() - self.pos < n {
            return Err(bad(self.path, "truncated body"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(
            b.try_into().map_err(|_| bad(self.path, "u64"))?,
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(
            b.try_into().map_err(|_| bad(self.path, "u32"))?,
        ))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn f32s(&mut self, expect: Option<usize>) -> Result<Vec<f32>> {
        let n = self.u64()? as usize;
        if let Some(e) = expect
            && e != n
        {
            return Err(bad(
                self.path,
                format!("array of {n} values, the model needs {e}"),
            ));
        }
        let bytes = self.take(
            n.checked_mul(4)
                .ok_or_else(|| bad(self.path, "array too large"))?,
        )?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// Reads a snapshot written by [`save`] for a model with `cfg` and `fingerprint`.
pub fn load(path: &Path, cfg: &ModelConfig, fingerprint: u32) -> Result<Snapshot> {
    let file = std::fs::read(path).map_err(|e| bad(path, format!("cannot read: {e}")))?;
    if file.len() < HEADER_LEN || &file[..8] != MAGIC {
        return Err(bad(
            path,
            "not a deltafin snapshot (bad magic or too short)",
        ));
    }
    let word = |at: usize| u32::from_le_bytes([file[at], file[at + 1], file[at + 2], file[at + 3]]);
    let version = word(8);
    if version != VERSION {
        return Err(bad(
            path,
            format!("snapshot version {version}, this build reads {VERSION}"),
        ));
    }
    if word(12) != fingerprint {
        return Err(bad(path, "snapshot was made with a different model"));
    }
    let crc = word(16);
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&file[20..28]);
    let body_len = u64::from_le_bytes(len_bytes) as usize;
    let body = &file[HEADER_LEN..];
    if body.len() != body_len {
        return Err(bad(
            path,
            format!(
                "body is {} bytes, header says {body_len} (truncated?)",
                body.len()
            ),
        ));
    }
    if crc32fast::hash(body) != crc {
        return Err(bad(path, "checksum mismatch (corrupt file)"));
    }
    let mut r = Reader {
        buf: body,
        pos: 0,
        path,
    };
    let n_tokens = r.u64()? as usize;
    let pending = r.u64()? as usize;
    if pending > n_tokens || n_tokens > body.len() {
        return Err(bad(path, "inconsistent token counts"));
    }
    let tokens = (0..n_tokens).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
    let state_tokens = r.u64()? as usize;
    let n_layers = r.u32()? as usize;
    if n_layers != cfg.n_layers {
        return Err(bad(
            path,
            format!("{n_layers} layers, the model has {}", cfg.n_layers),
        ));
    }
    let c = cfg.kda.n_heads * cfg.kda.head_dim;
    let window = (cfg.kda.conv_kernel - 1) * c;
    let s_len = cfg.kda.n_heads * cfg.kda.head_dim * cfg.kda.head_dim;
    let mla_row = cfg.mla.kv_lora_rank + cfg.mla.rope_dim;
    let mut layers = Vec::with_capacity(n_layers);
    for (l, kind) in cfg.layer_kinds.iter().enumerate() {
        let tag = r.u8()?;
        match (kind, tag) {
            (AttnKind::Kda, 0) => {
                let conv = [
                    r.f32s(Some(window))?,
                    r.f32s(Some(window))?,
                    r.f32s(Some(window))?,
                ];
                let s = r.f32s(Some(s_len))?;
                layers.push(LayerState::Kda(Arc::new(KdaState::new(conv, s))));
            }
            (AttnKind::Mla, 1) => {
                let width = r.u64()? as usize;
                if width != mla_row {
                    return Err(bad(
                        path,
                        format!("layer {l}: MLA rows of {width}, the model needs {mla_row}"),
                    ));
                }
                let rows = r.f32s(None)?;
                if rows.len() != state_tokens * width {
                    return Err(bad(
                        path,
                        format!("layer {l}: MLA cache does not hold {state_tokens} tokens"),
                    ));
                }
                let mut cache = MlaCache::default();
                cache.push_block(&rows, width);
                layers.push(LayerState::Mla(cache));
            }
            _ => return Err(bad(path, format!("layer {l}: state of the wrong kind"))),
        }
    }
    if r.pos != body.len() {
        return Err(bad(path, "trailing bytes after the last layer"));
    }
    if state_tokens + pending != n_tokens {
        return Err(bad(path, "state and token list disagree"));
    }
    Ok(Snapshot {
        tokens,
        pending,
        state: SessionState {
            layers,
            n_tokens: state_tokens,
        },
    })
}
