//! Bitwise on-policy: in a `--sync` run every token's teacher-forced log-prob under the
//! version that sampled it equals its behaviour log-prob bit for bit, so every importance
//! ratio is exactly 1 and the logprob gap exactly 0. The run covers what could break it:
//! micro-batches, top-k masks (kept-set renormalisation), multi-turn episodes (environment
//! tokens, resumed caches) and an MoE policy (routing replay).

use rlstream::bus::{MemoryBus, SharedBus};
use rlstream::commands::run::{self, RunOptions};
use rlstream::commands::sft::{self, SftOptions};
use rlstream::display::DisplayMode;
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

    let mut cfg = run::defaults(BuiltinTask::Guess);
    cfg.train.steps = 3;
    cfg.train.micro_batch_tokens = 200;
    cfg.generator.top_k = 6;
    cfg.run.eval_prompts = 0;
    let opts = RunOptions {
        prompts: run::RunPrompts::Task(BuiltinTask::Guess),
        model: Some(model),
        sft: SftOptions::default(),
        out: dir.path().join("run"),
        report: None,
        sync: true,
        seed: 3,
        display: DisplayMode::Quiet,
    };
    let bus: SharedBus = Arc::new(MemoryBus::new());
    let outcome = crate::common::run_alone(&opts, cfg, bus).await;
    assert_eq!(outcome.rows.len(), 3);
    for row in &outcome.rows {
        let r = &row.record;
        assert!(
            r.tokens > 200,
            "step {}: {} tokens, one micro-batch",
            r.step,
            r.tokens
        );
        assert_eq!(r.logprob_gap, 0.0, "step {}", r.step);
        assert_eq!((r.ratio_mean, r.ratio_max), (1.0, 1.0), "step {}", r.step);
        assert_eq!(r.mismatch_kl, 0.0, "step {}", r.step);
        assert_eq!(r.swap_tokens, 0, "step {}", r.step);
        assert_eq!(r.routing_mismatch, Some(0.0), "step {}", r.step);
    }
}
