//! The generator's rows, context limits, dropped requests and watched rows.

use super::*;
use crate::model::draw::tests::params;

#[test]
fn a_row_writes_whole_vocabulary_kept_sets_only_once_a_token_truncates() {
    let req = Request {
        id: 0,
        prompt: vec![1],
        n: 1,
        params: params(1.0, 0, 1.0),
    };
    let draw = |token, kept: Option<Vec<u32>>| Draw {
        token,
        logprob: -0.5,
        kept,
    };
    let vocab = 4;
    let mut plain = Row::new(&req, 0, 8);
    plain.push(draw(2, None), 0, vocab);
    plain.push(draw(3, None), 0, vocab);
    assert!(
        plain.kept_ids.is_empty(),
        "nothing stored while nothing truncates"
    );
    assert_eq!(plain.finish().mask, None);

    let mut mixed = Row::new(&req, 0, 8);
    mixed.push(draw(2, None), 0, vocab);
    mixed.push(draw(3, None), 0, vocab);
    mixed.push(draw(1, Some(vec![1, 3])), 0, vocab);
    mixed.push(draw(0, None), 0, vocab);
    let mask = mixed
        .finish()
        .mask
        .expect("a truncated token records the mask");
    assert_eq!(mask.offsets.as_slice(), [0, 4, 8, 10, 14]);
    assert_eq!(
        mask.ids.as_slice(),
        [0, 1, 2, 3, 0, 1, 2, 3, 1, 3, 0, 1, 2, 3]
    );
}

fn short_context_model() -> Policy<burn::backend::NdArray> {
    let mut cfg = super::super::ModelConfig::tiny(super::super::Architecture::Llama, 12);
    cfg.max_position = 8;
    cfg.eos_token_id = None;
    Policy::random(&cfg, 3, &Default::default()).expect("model")
}

#[test]
fn completions_end_where_the_context_ends_and_a_full_prompt_is_refused() {
    let model = short_context_model();
    let req = |prompt: Vec<u32>| Request {
        id: 0,
        prompt,
        n: 2,
        params: SamplingParams {
            max_new_tokens: 5,
            ..params(1.0, 0, 1.0)
        },
    };
    for (prompt_len, completion) in [(1, 5), (3, 5), (4, 4), (7, 1)] {
        let done = Generator::generate(&model, 0, &[req(vec![2; prompt_len])]).expect("ran");
        for c in &done {
            assert_eq!(c.tokens.len(), completion, "prompt of {prompt_len}");
            assert_eq!(c.finish, FinishReason::Length);
        }
    }
    let mut g = Generator::new();
    match g.admit(&model, 0, &req(vec![2; 8])) {
        Err(ModelError::Refused(r)) => assert_eq!(r.reason, "context"),
        other => panic!("a prompt of the whole context: {other:?}"),
    }
    match g.admit(&model, 0, &req(vec![2, 12])) {
        Err(ModelError::Refused(r)) => assert_eq!(r.reason, "vocabulary"),
        other => panic!("an id past the vocabulary: {other:?}"),
    }
    assert!(g.is_idle(), "a refused prompt leaves nothing behind");
}

#[test]
fn a_dropped_request_leaves_the_other_rows_decoding() {
    let model = short_context_model();
    let mut g = Generator::new();
    for (id, prompt) in [(0u64, vec![1, 2]), (1, vec![3])] {
        let r = Request {
            id,
            prompt,
            n: 2,
            params: params(1.0, 0, 1.0),
        };
        g.admit(&model, 0, &r).expect("admit");
    }
    let before = g.snapshot();
    g.forward(&model).expect("pass");
    g.restore(before);
    for i in 0..g.active() {
        g.probe_row(&model, i).expect("each row runs alone");
    }
    g.drop_request(0);
    assert_eq!(g.row_requests(), [1, 1]);
    let mut done = Vec::new();
    while !g.is_idle() {
        done.extend(g.step(&model, 0).expect("step"));
    }
    assert!(done.iter().all(|c| c.request_id == 1), "{}", done.len());
    assert_eq!(done.len(), 2);
}

#[test]
fn watched_rows_report_each_draw_and_a_row_ended_early_frees_only_itself() {
    let model = short_context_model();
    let mut g = Generator::new();
    let req = |id, n| Request {
        id,
        prompt: vec![1, 2],
        n,
        params: SamplingParams {
            max_new_tokens: 5,
            ..params(1.0, 0, 1.0)
        },
    };
    g.admit_watched(
        &model,
        3,
        &req(0, 2),
        Watch {
            alternatives: 2,
            keep: false,
        },
    )
    .expect("admit");
    g.admit(&model, 3, &req(1, 1)).expect("admit");
    let mut drawn = g.take_drawn();
    assert_eq!(drawn.len(), 2, "each watched row's first token");
    g.step(&model, 4).expect("step");
    drawn.extend(g.take_drawn());
    let ended = g
        .finish_row(0, 1, FinishReason::Stop)
        .expect("row 1 is decoding");
    assert_eq!(ended.tokens.len(), 2);
    assert_eq!(ended.finish, FinishReason::Stop);
    assert_eq!(g.row_requests(), [0, 1]);
    let mut done = vec![ended];
    while !g.is_idle() {
        done.extend(g.step(&model, 4).expect("step"));
        drawn.extend(g.take_drawn());
    }
    for c in done.iter().filter(|c| c.request_id == 0) {
        let mine: Vec<&Drawn> = drawn.iter().filter(|d| d.index == c.index).collect();
        let tokens: Vec<u32> = mine.iter().map(|d| d.token).collect();
        let logprobs: Vec<f32> = mine.iter().map(|d| d.logprob).collect();
        assert_eq!(tokens, c.tokens, "row {}", c.index);
        assert_eq!(logprobs, c.logprobs);
        let versions: Vec<u64> = mine.iter().map(|d| d.version).collect();
        assert_eq!(versions[0], 3);
        assert!(versions[1..].iter().all(|&v| v == 4));
        for d in mine {
            assert_eq!(d.alternatives.len(), 2, "two alternatives were asked for");
            assert!(
                d.alternatives[0].1 >= d.alternatives[1].1,
                "likeliest first"
            );
            if let Some(a) = d.alternatives.iter().find(|a| a.0 == d.token) {
                assert_eq!(a.1.to_bits(), d.logprob.to_bits(), "the drawn token's own");
            }
        }
    }
    assert!(
        drawn.iter().all(|d| d.request_id == 0),
        "request 1 is not watched"
    );
    assert_eq!(done.len(), 3);
}

/// Prompts admitted together (several lengths, so some rows are padded; more than one
/// pass) give every completion the tokens, log-prob bits and experts it gets admitted
/// alone, on a dense model and on a mixture of experts.
#[test]
fn prompts_prefilled_together_give_the_bits_of_each_alone() {
    use super::super::{Architecture, ModelConfig, MoeConfig};
    let dense = ModelConfig::tiny(Architecture::Llama, 40);
    let moe = ModelConfig::tiny(Architecture::Qwen3Moe, 40)
        .with_qk_norm(true)
        .with_moe(Some(MoeConfig::new(4, 2, 32)));
    for cfg in [dense, moe] {
        let model: Policy<burn::backend::NdArray> =
            Policy::random(&cfg, 5, &Default::default()).expect("model");
        let lens = [7usize, 3, 12, 7, 1, 0, 300, 9];
        let reqs: Vec<Request> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| Request {
                id: i as u64,
                prompt: (0..l).map(|j| ((i * 7 + j * 3) % 40) as u32).collect(),
                n: 1 + i % 3,
                params: SamplingParams {
                    max_new_tokens: 6,
                    seed: i as u64,
                    ..params(1.0, 0, 1.0)
                },
            })
            .collect();
        let together = Generator::generate(&model, 0, &reqs).expect("together");
        let mut alone = Vec::new();
        for r in &reqs {
            alone.extend(Generator::generate(&model, 0, std::slice::from_ref(r)).expect("alone"));
        }
        alone.sort_by_key(|c| (c.request_id, c.index));
        assert_eq!(together.len(), alone.len());
        for (a, b) in together.iter().zip(&alone) {
            assert_eq!(a.tokens, b.tokens, "request {}", a.request_id);
            let bits = |c: &Completion| c.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "request {}", a.request_id);
            assert_eq!(
                format!("{:?} {:?}", a.routing, a.prompt_routing),
                format!("{:?} {:?}", b.routing, b.prompt_routing),
                "request {}",
                a.request_id
            );
        }
    }
}

/// Passes hold at most the token budget once padded, and trade padding against passes.
#[test]
fn prefill_passes_bound_their_tokens_and_trade_padding_for_passes() {
    let lens = [1usize, 2, 2, 3, 100, 100, 101, 5000, 5000, 9000];
    let order: Vec<usize> = (0..lens.len()).collect();
    let cut = passes(&order, |i| lens[i]);
    assert_eq!(cut.concat(), order, "every prompt once, in order");
    for p in &cut {
        let longest = lens[p[p.len() - 1]];
        assert!(p.len() == 1 || p.len() * longest <= PREFILL_TOKENS, "{p:?}");
    }
    // The short prompts together, the hundreds together (padding them to 101 is cheaper
    // than a pass, padding the short ones to 100 is not), each long one alone.
    let want: Vec<Vec<usize>> = vec![vec![0, 1, 2, 3], vec![4, 5, 6], vec![7], vec![8], vec![9]];
    assert_eq!(cut, want);
    // Ascending lengths 6 to 9 (an endpoint's calls admitted together): one pass.
    let lens: Vec<usize> = [6; 8]
        .into_iter()
        .chain([7; 8])
        .chain([8; 8])
        .chain([9; 7])
        .collect();
    let order: Vec<usize> = (0..lens.len()).collect();
    assert_eq!(passes(&order, |i| lens[i]), vec![order.clone()]);
}

/// A call that extends what a kept row's cache holds continues from it, prefilling only
/// its new tokens, and samples exactly what a fresh prefill of the whole prompt samples
/// under the same version, bit for bit; under another version, or with a prompt that does
/// not extend it, the prompt is prefilled whole. The kept row came from a batch whose
/// other prompt was longer (its cache row padded).
#[test]
fn a_continued_cache_samples_the_bits_of_a_fresh_prefill() {
    let cfg = super::super::ModelConfig::tiny(super::super::Architecture::Llama, 40);
    let model: Policy<burn::backend::NdArray> =
        Policy::random(&cfg, 5, &Default::default()).expect("model");
    let req = |id, prompt: Vec<u32>, seed| Request {
        id,
        prompt,
        n: 1,
        params: SamplingParams {
            max_new_tokens: 6,
            seed,
            ..params(1.0, 0, 0.95)
        },
    };
    let keep = Watch {
        alternatives: 0,
        keep: true,
    };
    let run = |g: &mut Generator<_>, version| {
        let mut done = g.take_done();
        while !g.is_idle() {
            done.extend(g.step(&model, version).expect("step"));
        }
        done
    };
    let mut g = Generator::new();
    let first = req(0, vec![3, 1, 4, 1, 5], 7);
    let other = req(1, (0..17).map(|i| i % 40).collect(), 8);
    g.admit_all_watched(&model, 2, &[first, other], &[keep, Watch::default()])
        .expect("admit");
    let done = run(&mut g, 2);
    let c = done.iter().find(|c| c.request_id == 0).expect("finished");
    assert!(g.take_kept(1).is_none(), "only a kept row leaves its cache");
    let kept = g.take_kept(0).expect("the first row's cache is kept");
    let fed = c.tokens.len() - 1;
    let held: Vec<u32> = [3, 1, 4, 1, 5]
        .iter()
        .chain(&c.tokens[..fed])
        .copied()
        .collect();
    assert_eq!(kept.ids, held, "the prompt and every fed completion token");
    assert_eq!(kept.version, 2);
    assert!(kept.bytes() > 0);

    let mut next: Vec<u32> = vec![3, 1, 4, 1, 5];
    next.extend(&c.tokens);
    next.extend([9, 2, 6]);
    let fresh = |version| {
        let mut g = Generator::new();
        g.admit(&model, version, &req(5, next.clone(), 11))
            .expect("admit");
        run(&mut g, version).remove(0)
    };
    let mut g = Generator::new();
    let continued = g
        .admit_continued(&model, 2, &req(5, next.clone(), 11), keep, kept)
        .expect("admit");
    assert!(continued, "same version, an extending prompt");
    let got = run(&mut g, 2).remove(0);
    let want = fresh(2);
    assert_eq!(got.tokens, want.tokens);
    let bits = |c: &Completion| c.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got),
        bits(&want),
        "log-probs of a fresh prefill, bit for bit"
    );
    // It left its own cache, holding the whole new prompt.
    let again = g.take_kept(5).expect("kept again");
    assert!(again.ids.starts_with(&next));

    // Another version since: prefilled whole, as a fresh call at that version.
    let mut g = Generator::new();
    let continued = g
        .admit_continued(&model, 3, &req(5, next.clone(), 11), keep, again)
        .expect("admit");
    assert!(!continued, "the weights changed");
    assert_eq!(bits(&run(&mut g, 3).remove(0)), bits(&fresh(3)));
    // A prompt that does not extend the cache: prefilled whole.
    let stale = g.take_kept(5).expect("kept");
    let mut g = Generator::new();
    let edited = req(6, vec![3, 1, 4, 2, 5, 9], 1);
    assert!(
        !g.admit_continued(&model, 3, &edited, keep, stale)
            .expect("admit")
    );
}
