//! Bitwise on-policy: in a `--sync` run every token's teacher-forced log-prob under the
//! version that sampled it equals its behaviour log-prob bit for bit, so every importance
//! ratio is exactly 1 and the logprob gap exactly 0. The run covers what could break it:
//! micro-batches, top-k masks (kept-set renormalisation), multi-turn episodes (environment
//! tokens, resumed caches) and an MoE policy (routing replay), under every objective
//! (GSPO's sequence ratios are exactly 1 too; CISPO's run recomputes the trunk layer by
//! layer in the backward, gradient checkpointing), and with several updates per step, under
//! decoupled PPO too, on the first update (where the proximal policy is the behaviour's).

use rlstream::bus::{MemoryBus, SharedBus};
use rlstream::commands::run::{self, RunOptions};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::display::DisplayMode;
use rlstream::stages::train::{LossAgg, LossKind, ProxMethod, TrainConfig};
use rlstream::tasks::BuiltinTask;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_run_has_ratios_of_exactly_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("sft");
    let warm = SftOptions {
        task: BuiltinTask::Guess,
        out: model.clone(),
        steps: 30,
        experts: 4,
        eval: 0,
        ..SftOptions::default()
    };
    sft::run(&warm, |_, _| {}).unwrap();

    // PPO for three steps, then each other objective for two; then several updates per
    // step (two mini-batches, two epochs) under decoupled PPO, its proximal log-probs
    // recomputed and interpolated, and PPO with an entropy bonus.
    let several = |prox: Option<ProxMethod>| {
        move |t: &mut TrainConfig| {
            t.ppo_mini_batch_size = 4;
            t.ppo_epochs = 2;
            if let Some(p) = prox {
                t.use_decoupled_loss = true;
                t.prox_logp_method = p;
            }
        }
    };
    let same = |_: &mut TrainConfig| {};
    type Tweak<'a> = &'a dyn Fn(&mut TrainConfig);
    let objectives: [(LossKind, LossAgg, u64, Tweak); 8] = [
        (LossKind::Ppo, LossAgg::TokenMean, 3, &same),
        (LossKind::Gspo, LossAgg::SeqMeanTokenMean, 2, &same),
        (
            LossKind::Cispo,
            LossAgg::TokenMean,
            2,
            &|t: &mut TrainConfig| t.gradient_checkpointing = true,
        ),
        (LossKind::Tis, LossAgg::SeqMeanTokenSumNorm, 2, &same),
        (LossKind::Reinforce, LossAgg::SeqMeanTokenSum, 2, &same),
        (
            LossKind::Ppo,
            LossAgg::TokenMean,
            2,
            &several(Some(ProxMethod::Recompute)),
        ),
        (
            LossKind::Gspo,
            LossAgg::SeqMeanTokenMean,
            2,
            &several(Some(ProxMethod::Loglinear)),
        ),
        (
            LossKind::Ppo,
            LossAgg::TokenMean,
            2,
            &|t: &mut TrainConfig| t.entropy_coeff = 0.01,
        ),
    ];
    for (n, (loss, agg, steps, tweak)) in objectives.into_iter().enumerate() {
        let mut cfg = run::defaults(BuiltinTask::Guess);
        cfg.train.steps = steps;
        cfg.train.loss = loss;
        cfg.train.loss_agg_mode = agg;
        cfg.train.micro_batch_tokens = 200;
        tweak(&mut cfg.train);
        assert_eq!(cfg.policy.groups_per_step, 8);
        let updates = if cfg.train.ppo_mini_batch_size > 0 {
            4
        } else {
            1
        };
        cfg.generator.top_k = 6;
        cfg.run.eval_prompts = 0;
        let opts = RunOptions {
            prompts: run::RunPrompts::Task(BuiltinTask::Guess),
            model: Some(model.clone()),
            sft: SftOptions::default(),
            out: dir.path().join(format!("run-{n}-{loss:?}")),
            report: None,
            sync: true,
            seed: 3,
            display: DisplayMode::Quiet,
        };
        let bus: SharedBus = Arc::new(MemoryBus::new());
        let outcome = crate::common::run_alone(&opts, cfg, bus).await;
        assert_eq!(outcome.rows.len(), steps as usize, "{loss:?}");
        for row in &outcome.rows {
            let r = &row.record;
            let at = format!("{loss:?} step {}", r.step);
            assert!(r.tokens > 200, "{at}: {} tokens, one micro-batch", r.tokens);
            assert_eq!(r.logprob_gap, 0.0, "{at}");
            assert_eq!(r.mismatch_kl, 0.0, "{at}");
            assert_eq!(r.prox_gap, 0.0, "{at}");
            assert_eq!(r.updates, updates, "{at}");
            assert!(r.policy_entropy > 0.0, "{at}");
            if updates == 1 {
                assert_eq!((r.ratio_mean, r.ratio_max), (1.0, 1.0), "{at}");
                assert_eq!(r.seq_ratio_std, 0.0, "{at}");
            } else {
                // The later updates move the policy away from the behaviour.
                assert!(r.ratio_max > 1.0, "{at}: {r:?}");
            }
            assert_eq!(r.swap_tokens, 0, "{at}");
            assert_eq!(r.routing_mismatch, Some(0.0), "{at}");
        }
    }
}
