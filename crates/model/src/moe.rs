//! The routed MoE: fp32 sigmoid router (bias for selection only), routed experts at latent (K3) or hidden width,
//! combine, latent norm and up-projection, plus the shared experts.
//!
//! All rows of a call are routed first; then each distinct expert is fetched once from the
//! [`ExpertSource`] and applied to every row that chose it, so a prefill chunk reads
//! each expert once per layer.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Instant;

use rayon::prelude::*;

use candle_core::Tensor;
use deltafin_quant::mxfp4::{Mxfp4Product, gemm_batch_with};
use deltafin_quant::mxfp4_bf16_contract::bf16_rounded;
use deltafin_quant::mxfp4_i16_contract;
use deltafin_quant::{DenseData, DenseMatrix, Mxfp4Input};

use crate::config::{Activation, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::layer::Pass;
use crate::mlp::Mlp;
use crate::ops::{
    glu_in_place, glu_values, linear, linear_many, rms_norm, sigmoid, tensor, values,
};
use crate::profile::Phase;
use crate::weights::{ExpertSource, ExpertWeights, Loader};

/// Added to the sum of chosen weights before renormalising, as in the reference.
const RENORM_EPS: f32 = 1e-20;

/// A dense expert's input as `input` says the experts read theirs: as is, rounded to bf16 or quantised to int16 per
/// group as the MXFP4 kernels read it, so each mode means one thing for both kinds of expert.
fn rounded(v: &[f32], input: Mxfp4Input) -> Cow<'_, [f32]> {
    match input {
        Mxfp4Input::F32 => Cow::Borrowed(v),
        Mxfp4Input::Bf16 => v.iter().copied().map(bf16_rounded).collect(),
        Mxfp4Input::I16 => Cow::Owned(mxfp4_i16_contract::dequantised(v)),
    }
}

/// K3's latent projections around the routed experts.
#[derive(Debug)]
struct Latent {
    down: DenseMatrix,
    norm: Option<Vec<f32>>,
    up: DenseMatrix,
}

/// One MoE layer's non-expert weights.
#[derive(Debug)]
pub struct Moe {
    layer: usize,
    cfg: MoeConfig,
    act: Activation,
    width: usize,
    eps: f32,
    router: DenseMatrix,
    bias: Option<Vec<f32>>,
    latent: Option<Latent>,
    shared: Option<Mlp>,
    /// The routed experts on the GPU, when the model runs on CUDA.
    #[cfg(feature = "cuda")]
    gpu: Option<std::sync::Arc<crate::gpu::GpuExperts>>,
}

/// The routing decision for one row.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Chosen experts, best first.
    pub experts: Vec<usize>,
    /// Their combine weights.
    pub weights: Vec<f32>,
}

/// Hands `experts` the guess of `next`'s experts from this layer's input `x`, when there is a next MoE layer and the
/// source wants guesses (a guess costs a router product, so it is made only then).
fn prefetch_next(next: Option<&Moe>, x: &Tensor, experts: &dyn ExpertSource) -> Result<()> {
    match next {
        Some(next) if experts.wants_prefetch() => experts.prefetch(next.layer, &next.guess(x)?),
        _ => Ok(()),
    }
}

impl Moe {
    /// Loads layer `layer`'s router, latent projections and shared experts.
    pub(crate) fn load(ld: &Loader<'_>, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let m = &cfg.moe;
        let name = |s: &str| cfg.layer_tensor(layer, &format!("block_sparse_moe.{s}"));
        let bias_name = name("gate.e_score_correction_bias");
        let bias = if ld.has(&bias_name)? {
            Some(ld.vec(&bias_name, &[m.n_experts])?)
        } else {
            None
        };
        let latent = match m.latent {
            Some(l) => Some(Latent {
                down: ld.matrix(&name("routed_expert_down_proj.weight"), l, h)?,
                norm: if m.latent_norm {
                    Some(ld.vec(&name("routed_expert_norm.weight"), &[l])?)
                } else {
                    None
                },
                up: ld.matrix(&name("routed_expert_up_proj.weight"), h, l)?,
            }),
            None => None,
        };
        let shared = if m.n_shared > 0 {
            Some(Mlp::load(
                ld,
                &name("shared_experts."),
                h,
                m.n_shared * m.inter,
                cfg.activation,
            )?)
        } else {
            None
        };
        Ok(Self {
            layer,
            cfg: m.clone(),
            act: cfg.activation,
            width: cfg.expert_width(),
            eps: cfg.rms_eps,
            router: ld.matrix(&name("gate.weight"), m.n_experts, h)?,
            bias,
            latent,
            shared,
            #[cfg(feature = "cuda")]
            gpu: ld.gpu.as_ref().map(|g| g.experts.clone()),
        })
    }

    /// Routes every row of `x` (`[T, hidden]`, normed).
    pub fn route(&self, x: &Tensor) -> Result<Vec<Route>> {
        self.routes_of(&linear(x, &self.router)?)
    }

    /// The routes of router logits `[T, n_experts]`.
    fn routes_of(&self, logits: &Tensor) -> Result<Vec<Route>> {
        Ok(values(logits)?
            .chunks_exact(self.cfg.n_experts)
            .map(|row| self.route_row(row))
            .collect())
    }

    /// The routes of `x` and, for K3's latent MoE, its down projection into the experts' width, in one threaded
    /// job (both read `x`).
    fn route_and_project(&self, x: &Tensor) -> Result<(Vec<Route>, Tensor)> {
        match &self.latent {
            Some(l) => {
                let [logits, z]: [Tensor; 2] = linear_many(x, &[&self.router, &l.down])?
                    .try_into()
                    .map_err(|_| {
                        ModelError::Device("two linears gave another count".to_string())
                    })?;
                Ok((self.routes_of(&logits)?, z))
            }
            None => Ok((self.route(x)?, x.clone())),
        }
    }

    fn route_row(&self, logits: &[f32]) -> Route {
        let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
        let mut order: Vec<usize> = (0..scores.len()).collect();
        let choice = |e: usize| scores[e] + self.bias.as_ref().map_or(0.0, |b| b[e]);
        // Highest biased score first; lower id first on exact ties.
        order.sort_by(|&a, &b| choice(b).total_cmp(&choice(a)).then(a.cmp(&b)));
        order.truncate(self.cfg.top_k);
        let mut weights: Vec<f32> = order.iter().map(|&e| scores[e]).collect();
        if self.cfg.renormalize {
            let sum: f32 = weights.iter().sum::<f32>() + RENORM_EPS;
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        weights
            .iter_mut()
            .for_each(|w| *w *= self.cfg.routed_scaling);
        Route {
            experts: order,
            weights,
        }
    }

    /// The experts this layer's router would pick for the rows of `x` (`[T, hidden]`, normed), as distinct ids.
    pub fn guess(&self, x: &Tensor) -> Result<Vec<usize>> {
        let mut ids: Vec<usize> = self.route(x)?.into_iter().flat_map(|r| r.experts).collect();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    /// This layer's index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// `[T, hidden] -> [T, hidden]`. `next`, the next MoE layer, is asked to guess its experts from this layer's
    /// input when the source wants prefetch guesses; the guess is handed to the source before this layer's own
    /// experts are requested, so its reads queue behind them and keep the disk busy across the layer boundary.
    pub fn forward(&self, x: &Tensor, pass: &Pass<'_>, next: Option<&Moe>) -> Result<Tensor> {
        let (experts, profile) = (pass.experts, pass.profile);
        let routing_from = Instant::now();
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu
            && let Some(y) = self.forward_gpu(g, x, experts, next)?
        {
            return Ok(y);
        }
        let (routes, z) = self.route_and_project(x)?;
        let t_len = routes.len();
        // expert -> rows that chose it.
        let mut users: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        // Row t's experts in the router's order: (expert, weight, the row's place among the expert's rows).
        let mut slots: Vec<Vec<(usize, f32, usize)>> = Vec::with_capacity(t_len);
        for (t, r) in routes.iter().enumerate() {
            let mut row = Vec::with_capacity(r.experts.len());
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                let rows = users.entry(e).or_default();
                row.push((e, w, rows.len()));
                rows.push(t);
            }
            slots.push(row);
        }
        let ids: Vec<usize> = users.keys().copied().collect();
        // The reads go out now; the shared experts are computed while they run.
        let fetch = experts.begin(self.layer, &ids)?;
        prefetch_next(next, x, experts)?;
        let z_vals = values(&z)?;
        let z_rows: Vec<&[f32]> = z_vals.chunks_exact(self.width).collect();
        let routing = routing_from.elapsed();
        let shared = profile.time(Phase::SharedExperts, || {
            self.shared.as_ref().map(|s| s.forward(x)).transpose()
        })?;

        // Each expert's outputs, `[rows that chose it, width]` in `users` order, whatever order the experts arrive in;
        // the combine below walks each row's experts in the router's order.
        let mut outs: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        let mut waited_from = Instant::now();
        fetch.finish(&mut |ready| {
            profile.add(Phase::ExpertWait, waited_from.elapsed());
            let started = Instant::now();
            let batch: Vec<(usize, Vec<&[f32]>, &ExpertWeights)> = ready
                .iter()
                .map(|(i, w)| {
                    let e = ids[*i];
                    (e, users[&e].iter().map(|&t| z_rows[t]).collect(), &**w)
                })
                .collect();
            for ((e, _, _), y) in batch
                .iter()
                .zip(self.experts_forward(&batch, pass.expert_input)?)
            {
                outs.insert(*e, y);
            }
            profile.add(Phase::ExpertCompute, started.elapsed());
            waited_from = Instant::now();
            Ok(())
        })?;
        let trunk_from = Instant::now();
        let width = self.width;
        let mut combined = deltafin_quant::zeroed::zeroed(t_len * width);
        let add_row = |(dst, row_slots): (&mut [f32], &Vec<(usize, f32, usize)>)| {
            for &(e, w, j) in row_slots {
                if let Some(y) = outs.get(&e).and_then(|y| y.get(j * width..(j + 1) * width)) {
                    for (d, v) in dst.iter_mut().zip(y) {
                        *d += w * v;
                    }
                }
            }
        };
        if t_len > 1 {
            combined
                .par_chunks_mut(width.max(1))
                .zip(slots.par_iter())
                .for_each(add_row);
        } else {
            combined
                .chunks_mut(width.max(1))
                .zip(&slots)
                .for_each(add_row);
        }
        let y = self.tail(combined, t_len, shared)?;
        profile.add(Phase::MoeTrunk, trunk_from.elapsed() + routing);
        Ok(y)
    }

    /// What follows the combine on every device: `[t_len, width]` combined expert outputs through the latent norm
    /// and up-projection (latent MoE), plus the shared experts' output.
    fn tail(&self, combined: Vec<f32>, t_len: usize, shared: Option<Tensor>) -> Result<Tensor> {
        let mut y = tensor(combined, t_len, self.width)?;
        if let Some(l) = &self.latent {
            if let Some(n) = &l.norm {
                y = rms_norm(&y, n, self.eps)?;
            }
            y = linear(&y, &l.up)?;
        }
        if let Some(s) = shared {
            y = (y + s)?;
        }
        Ok(y)
    }

    /// The GPU path: routed experts through the device expert cache and the MXFP4 kernels, with the shared
    /// experts computed while missing experts upload. When the source wants guesses, the next MoE layer's guess is
    /// handed over after the shared experts, by which time the upload helper has long asked for this layer's
    /// experts (its first step), so the guessed reads queue behind them. `None` when the experts are not MXFP4.
    #[cfg(feature = "cuda")]
    fn forward_gpu(
        &self,
        g: &crate::gpu::GpuExperts,
        x: &Tensor,
        experts: &dyn ExpertSource,
        next: Option<&Moe>,
    ) -> Result<Option<Tensor>> {
        let routes = self.route(x)?;
        let t_len = routes.len();
        let z = match &self.latent {
            Some(l) => linear(x, &l.down)?,
            None => x.clone(),
        };
        let shared = || {
            let s = self.shared.as_ref().map(|s| s.forward(x)).transpose()?;
            prefetch_next(next, x, experts)?;
            Ok(s)
        };
        let Some((combined, shared)) = g.run(self.layer, &values(&z)?, &routes, experts, shared)?
        else {
            return Ok(None);
        };
        self.tail(combined, t_len, shared).map(Some)
    }

    /// Applies each expert `(e, rows, weights)` of `batch` to its rows (each `width` long):
    /// `w2 · act(w1·x, w3·x)`, the outputs `[rows, width]` in one vector per expert. MXFP4 experts are multiplied
    /// together, the gate and up projections of all of them in one threaded pass and the down projections in a
    /// second; the copies and the activation between run on every thread too (for a long prompt they move
    /// hundreds of megabytes per layer).
    fn experts_forward(
        &self,
        batch: &[(usize, Vec<&[f32]>, &ExpertWeights)],
        input: Mxfp4Input,
    ) -> Result<Vec<Vec<f32>>> {
        let (inter, width) = (self.cfg.inter, self.width);
        let quant_err = |e: usize| {
            move |source| ModelError::Expert {
                layer: self.layer,
                expert: e,
                source,
            }
        };
        let inputs: Vec<Vec<f32>> = batch.par_iter().map(|(_, rows, _)| rows.concat()).collect();
        // (position in `batch`, [w1, w2, w3]) of each MXFP4 expert.
        let mut mxfp4 = Vec::with_capacity(batch.len());
        for (k, &(e, _, weights)) in batch.iter().enumerate() {
            if let ExpertWeights::Mxfp4(p) = weights {
                if p.shapes() != [(inter, width), (width, inter), (inter, width)] {
                    return Err(ModelError::BadWeight {
                        name: format!("layer {} expert {e}", self.layer),
                        msg: format!("MXFP4 shapes {:?}", p.shapes()),
                    });
                }
                mxfp4.push((k, p.matrices().map_err(quant_err(e))?));
            }
        }
        let t_of = |k: usize| batch[k].1.len();
        // A shape error names the first expert of the pass (shapes were checked above, so it cannot happen).
        let pass_err = quant_err(mxfp4.first().map_or(0, |&(k, _)| batch[k].0));
        // Gate and up of every MXFP4 expert in one pass.
        let zeros = || -> Vec<Vec<f32>> {
            mxfp4
                .iter()
                .map(|&(k, _)| vec![0.0; t_of(k) * inter])
                .collect()
        };
        let (mut gates, mut ups) = (zeros(), zeros());
        let mut products = Vec::with_capacity(2 * mxfp4.len());
        for ((&(k, [w1, _, w3]), gate), up) in
            mxfp4.iter().zip(gates.iter_mut()).zip(ups.iter_mut())
        {
            for (matrix, y) in [(w1, gate), (w3, up)] {
                products.push(Mxfp4Product {
                    matrix,
                    x: &inputs[k],
                    t_rows: t_of(k),
                    y,
                });
            }
        }
        gemm_batch_with(&mut products, input).map_err(pass_err)?;
        drop(products);
        // Then every down projection in one pass.
        // Every expert's activation in one threaded job (a K3 expert's 3072 SiTU values cost about 0.1 ms each),
        // into its gate outputs.
        glu_in_place(
            self.act,
            gates
                .iter_mut()
                .map(Vec::as_mut_slice)
                .zip(ups.iter().map(Vec::as_slice)),
        );
        drop(ups);
        let acts = gates;
        let mut downs: Vec<Vec<f32>> = mxfp4
            .iter()
            .map(|&(k, _)| vec![0.0; t_of(k) * width])
            .collect();
        let mut products: Vec<Mxfp4Product<'_, '_>> = mxfp4
            .iter()
            .zip(&acts)
            .zip(downs.iter_mut())
            .map(|((&(k, [_, w2, _]), a), y)| Mxfp4Product {
                matrix: w2,
                x: a,
                t_rows: t_of(k),
                y,
            })
            .collect();
        gemm_batch_with(&mut products, input).map_err(pass_err)?;
        drop(products);
        let mut downs = downs.into_iter();
        let mut out = Vec::with_capacity(batch.len());
        for (k, &(e, _, weights)) in batch.iter().enumerate() {
            let y = match weights {
                ExpertWeights::Mxfp4(_) => downs.next().unwrap_or_default(),
                ExpertWeights::Dense { w1, w2, w3 } => {
                    self.dense_expert(e, [w1, w2, w3], &inputs[k], t_of(k), input)?
                }
            };
            out.push(y);
        }
        Ok(out)
    }

    /// A dense (f32) expert `e` on `t` rows `x`: `w2 · act(w1·x, w3·x)`.
    fn dense_expert(
        &self,
        e: usize,
        [w1, w2, w3]: [&Vec<f32>; 3],
        x: &[f32],
        t: usize,
        input: Mxfp4Input,
    ) -> Result<Vec<f32>> {
        let (inter, width) = (self.cfg.inter, self.width);
        let mat = |r, c, v: &Vec<f32>| {
            DenseMatrix::new(r, c, DenseData::F32(v.clone())).map_err(|err| ModelError::BadWeight {
                name: format!("layer {} expert {e}", self.layer),
                msg: err.to_string(),
            })
        };
        let quant_err = |source| ModelError::Expert {
            layer: self.layer,
            expert: e,
            source,
        };
        let (w1, w2, w3) = (
            mat(inter, width, w1)?,
            mat(width, inter, w2)?,
            mat(inter, width, w3)?,
        );
        let x = rounded(x, input);
        let gate = w1.gemm(&x, t).map_err(quant_err)?;
        let up = w3.gemm(&x, t).map_err(quant_err)?;
        w2.gemm(&rounded(&self.glu_rows(&gate, &up), input), t)
            .map_err(quant_err)
    }

    /// The expert activation of gate and up outputs, element by element, on every thread.
    fn glu_rows(&self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        glu_values(self.act, gate, up)
    }
}
