//! Routing replay on a tiny random Qwen3-MoE policy: the sampler records every read
//! token's experts per MoE layer (prompt once, completions without their last token) as a
//! full recompute would choose them; the trainer's replay runs exactly the recorded experts
//! while its router keeps a gradient; routing that does not fit the message or the model
//! is refused.

use burn::tensor::{Int, Tensor, TensorData};
use rlstream::model::logprobs::{Routed, ScoredSeq, completion_logprobs_routed};
use rlstream::model::moe::{LIVE, Routes};
use rlstream::model::sampler::{Completion, Generator, Request};
use rlstream::model::{Architecture, InferBackend, ModelConfig, MoeConfig, Policy, TrainBackend};
use rlstream::schema::{self, Refusal, RolloutGroup, SamplingParams};

const VOCAB: usize = 40;

fn config() -> ModelConfig {
    let mut moe = MoeConfig::new(6, 2, 24);
    // A dense layer between the sparse ones: layers 0 and 2 route.
    moe.dense_layers = vec![1];
    ModelConfig::new(Architecture::Qwen3Moe, VOCAB, 32, 48, 3, 4, 2, 8)
        .with_qk_norm(true)
        .with_moe(Some(moe))
        .with_max_position(64)
}

/// A random policy whose routers are scaled up, so that no decision sits on a float tie
/// and two passes computed in different orders choose the same experts.
fn policy<B: rlstream::model::Kernels>(seed: u64, router_scale: f32) -> Policy<B> {
    let device = Default::default();
    let mut t = Policy::<B>::random(&config(), seed, &device)
        .unwrap()
        .to_tensors()
        .unwrap();
    for (name, tensor) in t.iter_mut() {
        if name.ends_with("mlp.gate.weight") {
            tensor.data.iter_mut().for_each(|x| *x *= router_scale);
        }
    }
    Policy::from_tensors(&config(), &t, &device).unwrap()
}

fn sample(model: &Policy<InferBackend>, prompt: &[u32], n: usize) -> Vec<Completion> {
    let req = Request {
        id: 0,
        prompt: prompt.to_vec(),
        n,
        params: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 12,
            stop_tokens: vec![],
            seed: 5,
        },
    };
    Generator::generate(model, 0, &[req]).unwrap()
}

/// The experts a full pass over `tokens` chooses, `[tokens, layers, k]`.
fn full_pass(model: &Policy<InferBackend>, tokens: &[u32]) -> Vec<u16> {
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let t = Tensor::<InferBackend, 2, Int>::from_data(
        TensorData::new(ids, [1, tokens.len()]),
        &Default::default(),
    );
    let mut routes = Routes::recording();
    model.hidden_routed(t, &mut routes);
    routes.used
}

#[test]
fn the_sampler_records_the_experts_of_every_token_it_read() {
    let model = policy::<InferBackend>(1, 40.0);
    let prompt = [1, 7, 9, 3, 22];
    let done = sample(&model, &prompt, 3);
    for c in &done {
        let prompt_routing = c.prompt_routing.as_deref().expect("prompt routing");
        let own = c.routing.as_ref().expect("completion routing");
        assert_eq!(prompt_routing.tokens(), prompt.len());
        assert_eq!(own.tokens(), c.tokens.len() - 1, "every token but the last");
        assert_eq!((own.layers, own.k, own.experts), (2, 2, 6));
        // Decoding one token at a time against the cache chose what a full pass chooses.
        let seq: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
        let full = full_pass(&model, &seq[..seq.len() - 1]);
        let recorded: Vec<u16> = prompt_routing
            .unpack()
            .into_iter()
            .chain(own.unpack())
            .collect();
        assert_eq!(recorded.len(), full.len());
        assert_eq!(recorded, full);
    }
    // The group as gen writes it validates and is 2.2.
    let samples: Vec<schema::Sample> = done.iter().cloned().map(Into::into).collect();
    let g = RolloutGroup {
        schema: RolloutGroup::version_for(&samples),
        prompt_tokens: prompt.to_vec().into(),
        prompt_routing: done[0].prompt_routing.as_deref().cloned(),
        samples,
        ..schema::examples::rollout_group(1, 1, 2, 0)
    };
    assert_eq!(g.schema, schema::SchemaVersion { major: 2, minor: 2 });
    let back: RolloutGroup = schema::decode(&schema::encode(&g).unwrap()).unwrap();
    assert_eq!(back, g);
    assert!(model.config().limits().rollout(&g).is_ok());
}

#[test]
fn replay_runs_the_recorded_experts_and_the_router_keeps_its_gradient() {
    let behaviour = policy::<InferBackend>(2, 40.0);
    let prompt = [1, 4, 8, 15, 16, 23];
    let done = sample(&behaviour, &prompt, 4);
    // The trainer's policy: the same experts, routers moved (a few versions later).
    let mut t = behaviour.to_tensors().unwrap();
    let mut k = 0u32;
    for (name, tensor) in t.iter_mut() {
        if name.ends_with("mlp.gate.weight") {
            for x in tensor.data.iter_mut() {
                k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                *x += ((k >> 16) % 1000) as f32 / 1000.0 - 0.5;
            }
        }
    }
    let device = Default::default();
    let trainer = Policy::<TrainBackend>::from_tensors(&config(), &t, &device).unwrap();
    let prompt_routing = done[0].prompt_routing.as_deref().unwrap();
    let seqs: Vec<ScoredSeq<'_>> = done
        .iter()
        .map(|c| ScoredSeq {
            prompt: &prompt,
            completion: &c.tokens,
            mask: None,
            routing: Some((prompt_routing, c.routing.as_ref().unwrap())),
        })
        .collect();

    // Live, the moved routers choose other experts for some decisions.
    let (_, _, live) = completion_logprobs_routed(&trainer, &seqs, 1.0, Routed::Live);
    let decisions = done
        .iter()
        .map(|c| prompt.len() + c.tokens.len() - 1)
        .sum::<usize>()
        * 2;
    assert_eq!(live.compared, decisions);
    assert!(
        live.differ > 0 && live.differ < decisions,
        "live mismatch {} of {decisions}",
        live.differ
    );

    // Replayed, every read token runs through exactly the recorded experts.
    let lmax = prompt.len() + done.iter().map(|c| c.tokens.len()).max().unwrap();
    let mut table = vec![LIVE; done.len() * lmax * 4];
    for (r, c) in done.iter().enumerate() {
        let ids: Vec<u16> = prompt_routing
            .unpack()
            .into_iter()
            .chain(c.routing.as_ref().unwrap().unpack())
            .collect();
        table[r * lmax * 4..r * lmax * 4 + ids.len()].copy_from_slice(&ids);
    }
    let inputs: Vec<i64> = done
        .iter()
        .flat_map(|c| {
            let mut row: Vec<i64> = prompt
                .iter()
                .chain(&c.tokens)
                .map(|&x| i64::from(x))
                .collect();
            row.resize(lmax, 0);
            row
        })
        .collect();
    let tokens = Tensor::<TrainBackend, 2, Int>::from_data(
        TensorData::new(inputs, [done.len(), lmax]),
        &device,
    );
    let mut routes = Routes::replaying(table.clone());
    routes.record = true;
    trainer.hidden_routed(tokens, &mut routes);
    let mut checked = 0;
    for (i, &want) in table.iter().enumerate() {
        if table[i - i % 2] != LIVE {
            assert_eq!(routes.used[i], want, "id {i}");
            checked += 1;
        }
    }
    assert_eq!(checked, decisions * 2, "100% of the recorded ids were run");
    assert_eq!(routes.replayed, decisions);

    // The gate weights come from the live router at the recorded experts: the router of
    // every MoE layer gets a gradient (a detached gate would leave it none).
    let (lp, valid, stats) = completion_logprobs_routed(&trainer, &seqs, 1.0, Routed::Replay);
    assert_eq!((stats.compared, stats.differ), (live.compared, live.differ));
    let grads = (lp * valid).sum().backward();
    for (i, block) in trainer.blocks.iter().enumerate() {
        let Some(moe) = &block.moe else {
            assert_eq!(i, 1, "layer 1 is dense");
            continue;
        };
        let g: Vec<f32> = moe
            .router
            .weight
            .grad(&grads)
            .expect("router gradient")
            .into_data()
            .to_vec()
            .unwrap();
        let norm: f32 = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(norm > 1e-6, "layer {i}: router gradient norm {norm}");
    }
}

#[test]
fn routing_that_does_not_fit_the_message_or_the_model_is_refused() {
    let model = policy::<InferBackend>(3, 40.0);
    let done = sample(&model, &[1, 2, 3], 2);
    let samples: Vec<schema::Sample> = done.iter().cloned().map(Into::into).collect();
    let good = RolloutGroup {
        schema: RolloutGroup::version_for(&samples),
        prompt_tokens: vec![1, 2, 3].into(),
        prompt_routing: done[0].prompt_routing.as_deref().cloned(),
        samples,
        ..schema::examples::rollout_group(1, 1, 2, 0)
    };
    let decode = |g: &RolloutGroup| {
        schema::decode::<RolloutGroup>(&schema::encode(g).unwrap()).map_err(|e| e.to_string())
    };
    assert!(decode(&good).is_ok());
    // Wrong length: a token short.
    let mut short = good.clone();
    let r = short.samples[0].routing.as_mut().unwrap();
    r.ids.truncate(r.ids.len() - 4);
    let e = decode(&short).unwrap_err();
    assert!(e.contains("samples[0].routing.ids"), "{e}");
    // An expert id past the experts.
    let mut past = good.clone();
    past.prompt_routing.as_mut().unwrap().ids[1] = 6;
    let e = decode(&past).unwrap_err();
    assert!(
        e.contains("prompt_routing") && e.contains("expert 6"),
        "{e}"
    );
    // Routing without the prompt's.
    let mut half = good.clone();
    half.prompt_routing = None;
    assert!(decode(&half).unwrap_err().contains("no prompt_routing"));
    // Well-formed, but for another model: three MoE layers, or more experts.
    let limits = model.config().limits();
    for (layers, experts, says) in [(3, 6, "3 MoE layers"), (2, 8, "top-2 of 8 experts")] {
        let mut other = good.clone();
        let shape = schema::RoutingShape {
            layers,
            k: 2,
            experts,
        };
        other.prompt_routing = Some(schema::examples::routing(shape, 3));
        for s in &mut other.samples {
            s.routing = Some(schema::examples::routing(shape, s.tokens.len() - 1));
        }
        let other = decode(&other).expect("well-formed");
        let refusal = limits.rollout(&other).expect_err("another model's routing");
        assert_eq!(refusal.reason, Refusal::ROUTING);
        assert!(refusal.detail.contains(says), "{refusal}");
        assert!(
            refusal
                .detail
                .contains("the model has 2 MoE layers, top-2 of 6"),
            "{refusal}"
        );
    }
    // A dense model takes no routing.
    let dense = ModelConfig::tiny(Architecture::Llama, VOCAB).limits();
    let refusal = dense.rollout(&good).expect_err("dense");
    assert!(refusal.detail.contains("the model is dense"), "{refusal}");
}
