//! Mixture-of-experts layers (Qwen2-MoE / Qwen3-MoE) and routing replay.
//!
//! A sparse layer's router is a linear map to one logit per expert; its softmax gives each
//! token's router probabilities, the token goes through the `top_k` most probable experts,
//! and their outputs are summed weighted by those probabilities (renormalised over the
//! chosen experts when `norm_topk_prob`). Qwen2-MoE adds a shared expert every token goes
//! through, scaled by `sigmoid(shared_expert_gate · x)`. This is `transformers`'
//! `Qwen3MoeSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`.
//!
//! **Routing replay** ("Keep Routing", as in R3, slime, verl): the choice of experts is a
//! discrete, host-side decision. A pass may take it from [`Routes::replay`] instead of
//! the live top-k: the recorded experts run, and the weights are the *live* router's
//! probabilities gathered at the recorded ids, so the router keeps its gradient. A pass
//! may also record the experts it used ([`Routes::record`]): the sampler does, and writes
//! them into the rollout message.

use super::kernels::Kernels;
use super::layers::{Mlp, linear};
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

/// A replay entry that means "route this token live" (padding, the last token of a
/// sequence, a sample without recorded routing).
pub const LIVE: u16 = u16::MAX;

#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    /// `[hidden, experts]` (HF `mlp.gate.weight` transposed).
    pub router: Linear<B>,
    pub experts: Vec<Mlp<B>>,
    /// Qwen2-MoE's shared expert and its `[hidden, 1]` sigmoid gate.
    pub shared: Option<Mlp<B>>,
    pub shared_gate: Option<Linear<B>>,
    top_k: usize,
    norm_topk_prob: bool,
    /// Which MoE layer this is (0 for the model's first sparse layer).
    index: usize,
}

/// How the MoE layers of one forward pass choose their experts, and what they chose.
///
/// Ids are laid out as in the rollout message: `[tokens, layers, k]`, the pass's tokens in
/// row-major `[batch, len]` order, `layers` the model's MoE layers.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    /// Experts to run; a token whose first id in a layer is [`LIVE`] routes live there.
    /// `None` routes every token live.
    pub replay: Option<Vec<u16>>,
    /// Whether the pass runs the `replay` experts; when not, it only counts how many of
    /// them the live router would choose differently (the mismatch of live routing).
    pub apply: bool,
    /// Whether to fill [`Routes::used`].
    pub record: bool,
    /// The experts each token ran through, in the replay layout (after a recording pass).
    pub used: Vec<u16>,
    /// Recorded (token, layer) decisions seen, and how many of them name another set of
    /// experts than the live router's top-k: the routing mismatch.
    pub replayed: usize,
    pub differ: usize,
    tokens: usize,
    layers: usize,
}

impl Routes {
    /// Replays `ids` (`[tokens, layers, k]`, [`LIVE`] where a token routes live).
    pub fn replaying(ids: Vec<u16>) -> Self {
        Routes {
            replay: Some(ids),
            apply: true,
            ..Default::default()
        }
    }

    /// Routes live, counting where the live experts differ from `ids`.
    pub fn comparing(ids: Vec<u16>) -> Self {
        Routes {
            replay: Some(ids),
            apply: false,
            ..Default::default()
        }
    }

    /// Routes live and records what was used.
    pub fn recording() -> Self {
        Routes {
            record: true,
            ..Default::default()
        }
    }

    /// Called by the model before a pass of `tokens` tokens through `layers` MoE layers.
    pub(crate) fn begin(&mut self, tokens: usize, layers: usize) {
        self.tokens = tokens;
        self.layers = layers;
        if self.record {
            self.used.clear();
        }
    }
}

/// The `k` most probable experts of each row of `probs` (`[tokens, experts]`), most
/// probable first, ties to the lower id.
fn top_k(probs: &[f32], experts: usize, k: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(probs.len() / experts.max(1) * k);
    let mut order: Vec<u16> = Vec::with_capacity(experts);
    for row in probs.chunks_exact(experts) {
        order.clear();
        order.extend(0..experts as u16);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

fn int_tensor<B: Backend, const D: usize>(
    v: Vec<i64>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D, Int> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

impl<B: Backend> Moe<B> {
    pub(crate) fn new(
        router: Linear<B>,
        experts: Vec<Mlp<B>>,
        shared: Option<(Mlp<B>, Linear<B>)>,
        top_k: usize,
        norm_topk_prob: bool,
        index: usize,
    ) -> Self {
        let (shared, shared_gate) = shared.unzip();
        Moe {
            router,
            experts,
            shared,
            shared_gate,
            top_k,
            norm_topk_prob,
            index,
        }
    }
}

impl<B: Kernels> Moe<B> {
    /// The layer on the rows `[b × l, hidden]` of a `[b, l]` batch.
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 2>,
        bl: [usize; 2],
        routes: &mut Routes,
    ) -> Tensor<B, 2> {
        let [n, d] = x.dims();
        let (e, k) = (self.experts.len(), self.top_k);
        let device = x.device();
        let probs = burn::tensor::activation::softmax(linear(&self.router, x.clone(), bl), 1);
        let host: Vec<f32> = probs.clone().detach().into_data().iter::<f32>().collect();
        let live = top_k(&host, e, k);
        let layers = routes.layers.max(self.index + 1);
        let slot = |t: usize| (t * layers + self.index) * k;
        let mut ids = live.clone();
        if let Some(replay) = &routes.replay {
            for t in 0..n {
                let Some(chosen) = replay.get(slot(t)..slot(t) + k) else {
                    continue;
                };
                if chosen[0] == LIVE || chosen.iter().any(|&c| c as usize >= e) {
                    continue;
                }
                let mine = &mut ids[t * k..(t + 1) * k];
                routes.replayed += 1;
                if chosen.iter().any(|c| !mine.contains(c)) {
                    routes.differ += 1;
                }
                if routes.apply {
                    mine.copy_from_slice(chosen);
                }
            }
        }
        if routes.record {
            if routes.used.len() < n * layers * k {
                routes.used.resize(n * layers * k, LIVE);
            }
            for t in 0..n {
                routes.used[slot(t)..slot(t) + k].copy_from_slice(&ids[t * k..(t + 1) * k]);
            }
        }
        // The gate weights: the live probabilities at the chosen experts.
        let chosen =
            int_tensor::<B, 2>(ids.iter().map(|&i| i64::from(i)).collect(), [n, k], &device);
        let mut w = probs.gather(1, chosen);
        if self.norm_topk_prob {
            let sum = w.clone().sum_dim(1);
            w = w / sum;
        }
        let w = w.reshape([n * k]);
        let mut out = Tensor::<B, 2>::zeros([n, d], &device);
        for (j, expert) in self.experts.iter().enumerate() {
            let (mut rows, mut slots) = (Vec::new(), Vec::new());
            for (at, &id) in ids.iter().enumerate() {
                if id as usize == j {
                    rows.push((at / k) as i64);
                    slots.push(at as i64);
                }
            }
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            let rows = int_tensor::<B, 1>(rows, [m], &device);
            let slots = int_tensor::<B, 1>(slots, [m], &device);
            let y = expert.forward(x.clone().select(0, rows.clone()), [1, m], None);
            let weight = w.clone().select(0, slots).reshape([m, 1]);
            out = out.select_assign(0, rows, y * weight, IndexingUpdateOp::Add);
        }
        if let (Some(shared), Some(gate)) = (&self.shared, &self.shared_gate) {
            let g = burn::tensor::activation::sigmoid(linear(gate, x.clone(), bl));
            out = out + shared.forward(x, bl, None) * g;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_probability_and_breaks_ties_low() {
        let probs = [0.1, 0.4, 0.1, 0.4, 0.7, 0.1, 0.1, 0.1];
        assert_eq!(top_k(&probs, 4, 2), vec![1, 3, 0, 1]);
    }
}
