//! One token drawn from a row of logits: the temperature, then top-k, then top-p
//! (renormalised), and the behaviour log-prob of the token under exactly that distribution
//! ([`token_logprob`], the trainer's definition), with the ids that survived truncation
//! (the sampling mask the trainer renormalises over).

use super::kernels::{inv_temperature, token_logprob};
use crate::schema::SamplingParams;
use rand::Rng;
use rand::rngs::StdRng;

/// One draw from a logits row.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub token: u32,
    pub logprob: f32,
    /// Ids kept by top-k/top-p, ascending; `None` when nothing was truncated.
    pub kept: Option<Vec<u32>>,
}

/// Samples one token from `logits` as `params` say.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut StdRng) -> Draw {
    let v = logits.len();
    if params.temperature <= 0.0 {
        let token = argmax(logits);
        return Draw {
            token: token as u32,
            logprob: 0.0,
            kept: None,
        };
    }
    let k = inv_temperature(params.temperature);
    let scaled: Vec<f32> = logits.iter().map(|&l| l * k).collect();
    let kept = truncated(&scaled, params);
    let support: Box<dyn Iterator<Item = usize> + '_> = match &kept {
        Some(ids) => Box::new(ids.iter().copied()),
        None => Box::new(0..v),
    };
    let ids: Vec<usize> = support.collect();
    let lse = logsumexp(ids.iter().map(|&i| scaled[i]));
    let u: f64 = rng.random();
    let mut acc = 0.0f64;
    let mut token = ids[ids.len() - 1];
    for &i in &ids {
        acc += f64::from((scaled[i] - lse).exp());
        if u < acc {
            token = i;
            break;
        }
    }
    let kept = kept.map(ascending);
    // The behaviour log-prob by the definition the trainer computes too.
    let (logprob, _) = token_logprob(
        logits,
        token,
        params.temperature,
        kept.as_deref().unwrap_or(&[]),
    );
    Draw {
        token: token as u32,
        logprob,
        kept,
    }
}

/// The ids top-k, then top-p keep of the tempered logits `scaled` (likeliest first for
/// top-p, in selection order for top-k alone); `None` when nothing is truncated.
fn truncated(scaled: &[f32], params: &SamplingParams) -> Option<Vec<usize>> {
    let v = scaled.len();
    let k = params.top_k as usize;
    let mut kept: Option<Vec<usize>> = None;
    if k > 0 && k < v {
        let mut idx: Vec<usize> = (0..v).collect();
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b))
        });
        idx.truncate(k);
        kept = Some(idx);
    }
    if params.top_p < 1.0 {
        let mut idx = kept.take().unwrap_or_else(|| (0..v).collect());
        idx.sort_unstable_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
        let lse = logsumexp(idx.iter().map(|&i| scaled[i]));
        let mut mass = 0.0f64;
        let mut keep = 0;
        for &i in &idx {
            mass += f64::from((scaled[i] - lse).exp());
            keep += 1;
            if mass >= f64::from(params.top_p) {
                break;
            }
        }
        idx.truncate(keep.max(1));
        if idx.len() < v {
            kept = Some(idx);
        }
    }
    kept
}

/// Kept ids as a sampling mask records them: ascending.
fn ascending(mut ids: Vec<usize>) -> Vec<u32> {
    ids.sort_unstable();
    ids.into_iter().map(|i| i as u32).collect()
}

/// The `n` likeliest ids of the distribution [`sample_token`] draws from with `params`
/// (tempered, truncated by top-k and top-p, renormalised over what is kept), likeliest
/// first (ties by id), each with its log-prob under that distribution by the same
/// definition, bit for bit, as the drawn token's ([`token_logprob`]). Fewer than `n` when
/// fewer ids can be drawn: greedy sampling lists only the argmax, at log-prob 0.
pub fn alternatives(logits: &[f32], params: &SamplingParams, n: usize) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    if params.temperature <= 0.0 {
        return vec![(argmax(logits) as u32, 0.0)];
    }
    let k = inv_temperature(params.temperature);
    let scaled: Vec<f32> = logits.iter().map(|&l| l * k).collect();
    let kept = truncated(&scaled, params).map(ascending);
    let mut ids: Vec<usize> = match &kept {
        Some(ids) => ids.iter().map(|&i| i as usize).collect(),
        None => (0..logits.len()).collect(),
    };
    let likelier = |a: &usize, b: &usize| scaled[*b].total_cmp(&scaled[*a]).then(a.cmp(b));
    if ids.len() > n {
        ids.select_nth_unstable_by(n - 1, likelier);
        ids.truncate(n);
    }
    ids.sort_unstable_by(likelier);
    let (_, lse) = token_logprob(
        logits,
        ids[0],
        params.temperature,
        kept.as_deref().unwrap_or(&[]),
    );
    ids.into_iter()
        .map(|i| (i as u32, logits[i] * k - lse))
        .collect()
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// log Σ exp, stable, accumulated in f64.
pub(crate) fn logsumexp(values: impl Iterator<Item = f32> + Clone) -> f32 {
    let m = values.clone().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = values.map(|x| f64::from(x - m).exp()).sum();
    m + s.ln() as f32
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Sampling at `temperature`, `top_k`, `top_p`, 8 new tokens, seed 1.
    pub(crate) fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            max_new_tokens: 8,
            stop_tokens: vec![],
            seed: 1,
        }
    }

    #[test]
    fn logprob_is_of_the_truncated_tempered_distribution() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, -3.0];
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..50 {
            let d = sample_token(&logits, &params(0.5, 2, 1.0), &mut rng);
            assert_eq!(d.kept.as_deref(), Some(&[0u32, 1][..]));
            let z = (4.0f32.exp() + 2.0f32.exp()).ln();
            assert!((d.logprob - (logits[d.token as usize] / 0.5 - z)).abs() < 1e-5);
        }
        // top-p 0.5 keeps only the first token here (p0 ≈ 0.57).
        let d = sample_token(&logits, &params(1.0, 0, 0.5), &mut rng);
        assert_eq!((d.token, d.kept.as_deref()), (0, Some(&[0u32][..])));
        assert!(d.logprob.abs() < 1e-6);
        // No truncation: no mask.
        assert!(
            sample_token(&logits, &params(1.0, 0, 1.0), &mut rng)
                .kept
                .is_none()
        );
        assert_eq!(
            sample_token(&logits, &params(0.0, 0, 1.0), &mut rng).token,
            0
        );
    }

    #[test]
    fn alternatives_are_the_likeliest_of_the_distribution_drawn_from() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, -3.0, 0.5];
        let mut rng = StdRng::seed_from_u64(5);
        for (t, k, p, n, want) in [
            (0.5, 3, 1.0, 5, vec![0u32, 1, 2]),
            (1.0, 0, 1.0, 2, vec![0, 1]),
            (1.0, 0, 1.0, 20, vec![0, 1, 2, 5, 3, 4]),
            (0.8, 0, 0.7, 4, vec![0, 1]),
        ] {
            let params = params(t, k, p);
            let alts = alternatives(&logits, &params, n);
            let ids: Vec<u32> = alts.iter().map(|a| a.0).collect();
            assert_eq!(ids, want, "t {t} k {k} p {p} n {n}");
            // Each is the log-prob a draw of that id records, bit for bit.
            for _ in 0..40 {
                let d = sample_token(&logits, &params, &mut rng);
                if let Some(a) = alts.iter().find(|a| a.0 == d.token) {
                    assert_eq!(a.1.to_bits(), d.logprob.to_bits());
                }
            }
            // Listing every id the distribution keeps, the probabilities add up to 1.
            if n >= logits.len() || k > 0 || p < 1.0 {
                let total: f64 = alts.iter().map(|a| f64::from(a.1).exp()).sum();
                assert!((total - 1.0).abs() < 1e-6, "{total}");
            }
        }
        assert_eq!(
            alternatives(&logits, &params(0.0, 0, 1.0), 3),
            vec![(0, 0.0)]
        );
        assert!(alternatives(&logits, &params(1.0, 0, 1.0), 0).is_empty());
    }

    #[test]
    fn empirical_frequencies_match_the_softmax() {
        let logits = [1.0f32, 0.0, -0.5, 0.3, -2.0, 0.8];
        let t = 0.8f32;
        let z: f32 = logits.iter().map(|l| (l / t).exp()).sum();
        let p: Vec<f64> = logits
            .iter()
            .map(|l| f64::from((l / t).exp() / z))
            .collect();
        let mut rng = StdRng::seed_from_u64(7);
        let n = 200_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[sample_token(&logits, &params(t, 0, 1.0), &mut rng).token as usize] += 1;
        }
        // Pearson chi-square with 5 degrees of freedom: 20.5 is the 0.999 quantile.
        let chi2: f64 = counts
            .iter()
            .zip(&p)
            .map(|(&c, &pi)| (c as f64 - n as f64 * pi).powi(2) / (n as f64 * pi))
            .sum();
        assert!(chi2 < 20.5, "chi2 = {chi2}, counts {counts:?}, p {p:?}");
    }
}
