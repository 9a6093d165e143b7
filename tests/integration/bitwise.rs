//! Bitwise on-policy: in a `--sync` run every token's teacher-forced log-prob under the
//! version that sampled it equals its behaviour log-prob bit for bit, so every importance
//! ratio is exactly 1 and the logprob gap exactly 0. The run covers what could break it:
//! micro-batches, top-k masks (kept-set renormalisation), multi-turn episodes (environment
//! tokens, resumed caches) and an MoE policy (routing replay), under every objective
//! (GSPO's sequence ratios are exactly 1 too).

use rlstream::bus::{MemoryBus, SharedBus};
use rlstream::commands::run::{self, RunOptions};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::display::DisplayMode;
use rlstream::stages::train::{LossAgg, LossKind};
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

    // PPO for three steps, then each other objective for two.
    let objectives = [
        (LossKind::Ppo, LossAgg::TokenMean, 3),
        (LossKind::Gspo, LossAgg::SeqMeanTokenMean, 2),
        (LossKind::Cispo, LossAgg::TokenMean, 2),
        (LossKind::Tis, LossAgg::SeqMeanTokenSumNorm, 2),
        (LossKind::Reinforce, LossAgg::SeqMeanTokenSum, 2),
    ];
    for (loss, agg, steps) in objectives {
        let mut cfg = run::defaults(BuiltinTask::Guess);
        cfg.train.steps = steps;
        cfg.train.loss = loss;
        cfg.train.loss_agg_mode = agg;
        cfg.train.micro_batch_tokens = 200;
        cfg.generator.top_k = 6;
        cfg.run.eval_prompts = 0;
        let opts = RunOptions {
            prompts: run::RunPrompts::Task(BuiltinTask::Guess),
            model: Some(model.clone()),
            sft: SftOptions::default(),
            out: dir.path().join(format!("run-{loss:?}")),
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
            assert_eq!((r.ratio_mean, r.ratio_max), (1.0, 1.0), "{at}");
            assert_eq!(r.mismatch_kl, 0.0, "{at}");
            assert_eq!(r.swap_tokens, 0, "{at}");
            assert_eq!(r.routing_mismatch, Some(0.0), "{at}");
        }
    }
}
