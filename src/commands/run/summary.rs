//! What a run measured and the paragraph it ends with: the summary saved as
//! `summary.json`, gathered from the trainer's and the generator's summaries and the report
//! rows.

use super::options::RunOptions;
use crate::commands::eval::{Estimate, EvalResult};
use crate::config::Config;
use crate::report::StepRow;
use crate::stages::generator::GenSummary;
use crate::stages::train::TrainSummary;
use serde::Serialize;
use std::collections::BTreeMap;

/// What a run did, as printed at the end and saved as `summary.json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// `async` or `sync`.
    pub mode: String,
    pub task: String,
    /// `memory` or `redis`.
    pub bus: String,
    /// The namespace of the run's streams: on Redis, where `rlstream replay --namespace`
    /// finds them; on the embedded bus they ended with the run.
    pub namespace: String,
    pub model_params: usize,
    pub warm_start_s: f64,
    pub steps: u64,
    /// Seconds of the RL phase (stages started to trainer done).
    pub wall_s: f64,
    pub trained_groups: u64,
    pub trained_tokens: u64,
    pub trained_tokens_per_s: f64,
    pub generated_groups: u64,
    pub generated_tokens: u64,
    /// With `--serve`: the tokens the generator decoded beyond the groups it published,
    /// the endpoint's calls (whose groups the agents publish); 0 without.
    pub served_tokens: u64,
    /// Prompts the feeder fed, and of them prompts fed again by the difficulty-aware feed
    /// (`--reoffer`).
    pub prompts_fed: u64,
    pub prompts_reoffered: u64,
    /// Mean over the first and the last tenth of the steps (at most 10 steps each).
    pub reward_start: f64,
    pub reward_end: f64,
    pub accuracy_start: f64,
    pub accuracy_end: f64,
    /// `rlstream eval` of the policy before RL, at the checkpoint nearest halfway and after
    /// (empty with `run.eval_prompts = 0`).
    pub held_out: Vec<HeldOut>,
    /// Held-out pass@1 after RL minus before, with its standard error.
    pub pass_at_1_gain: Option<Estimate>,
    /// Generator time waiting for prompts with nothing to decode, over the RL phase.
    pub gen_idle_fraction: f64,
    pub gen_busy_s: f64,
    pub gen_idle_s: f64,
    /// Sum of optimizer step times, and of the trainer's waits for data.
    pub train_busy_s: f64,
    pub train_wait_s: f64,
    pub swaps: u64,
    pub swap_stall_p50_s: f64,
    pub swap_stall_p99_s: f64,
    pub swap_stall_max_s: f64,
    /// Trained groups by staleness (versions behind the trainer).
    pub staleness: BTreeMap<u64, u64>,
    pub dropped: BTreeMap<String, u64>,
    pub config: Config,
}

impl RunSummary {
    /// The one-paragraph summary printed at the end.
    pub fn paragraph(&self) -> String {
        format!(
            "{mode} run of `{task}` on the {bus} bus: {steps} steps in {wall:.1} s after a {warm:.1} s \
             warm start. Training reward {r0:.3} -> {r1:.3}, sample accuracy {a0:.1}% -> {a1:.1}%. \
             {held}Trained {tt} tokens ({tps:.0}/s) from \
             {tg} groups; generated {gt} tokens in {gg} groups{served}. Generator idle {idle:.0}% of \
             the time; {swaps} weight swaps, stall p50 {p50:.1} us, p99 {p99:.1} us. {replay}",
            mode = self.mode,
            task = self.task,
            bus = self.bus,
            steps = self.steps,
            wall = self.wall_s,
            warm = self.warm_start_s,
            r0 = self.reward_start,
            r1 = self.reward_end,
            a0 = 100.0 * self.accuracy_start,
            a1 = 100.0 * self.accuracy_end,
            held = self.held_out_sentence(),
            tt = self.trained_tokens,
            tps = self.trained_tokens_per_s,
            tg = self.trained_groups,
            gt = self.generated_tokens,
            gg = self.generated_groups,
            served = self.served_clause(),
            idle = 100.0 * self.gen_idle_fraction,
            swaps = self.swaps,
            p50 = 1e6 * self.swap_stall_p50_s,
            p99 = 1e6 * self.swap_stall_p99_s,
            replay = self.replay_sentence(),
        )
    }

    /// The tokens the endpoint's calls decoded beside the stream's groups, when any.
    fn served_clause(&self) -> String {
        match self.served_tokens {
            0 => String::new(),
            n => format!(" and {n} more for the endpoint's calls"),
        }
    }

    /// What the run leaves for `rlstream replay`.
    pub fn replay_sentence(&self) -> String {
        if self.bus == "redis" {
            format!(
                "Its streams stay in Redis for `rlstream replay --redis URL --namespace {}`.",
                self.namespace
            )
        } else {
            "Its streams were on the embedded bus and ended with it, so there is nothing to \
             replay; a run given --redis URL keeps them for `rlstream replay`."
                .into()
        }
    }
}

/// A held-out evaluation at a point of the run.
#[derive(Debug, Clone, Serialize)]
pub struct HeldOut {
    /// Trainer steps taken by the evaluated weights (0: before RL).
    pub step: u64,
    /// Seconds into RL when that step finished (0 before RL): where the point sits on the
    /// wall-clock learning curve.
    #[serde(default)]
    pub time_s: f64,
    #[serde(flatten)]
    pub eval: EvalResult,
}

impl RunSummary {
    /// Held-out results before and after RL, pass@1 first, as one sentence (empty when the
    /// run did not evaluate).
    pub fn held_out_sentence(&self) -> String {
        let (Some(before), Some(after), Some(gain)) = (
            self.held_out.first(),
            self.held_out.last(),
            self.pass_at_1_gain,
        ) else {
            return String::new();
        };
        let (b, a) = (&before.eval, &after.eval);
        // An episode task's pass@1 is its success rate, its reward the episode's return.
        let tools = match (
            (&b.tool_call_rate, &a.tool_call_rate),
            (&b.tool_call_validity, &a.tool_call_validity),
        ) {
            ((Some(rb), Some(ra)), (Some(vb), Some(va))) => format!(
                ", tool called in {} -> {} of episodes, {} -> {} of calls valid",
                rb.percent(),
                ra.percent(),
                vb.percent(),
                va.percent()
            ),
            _ => String::new(),
        };
        let (unit, pass, reward, turns, greedy) = match (&b.turns, &a.turns) {
            (Some(tb), Some(ta)) => (
                "games",
                "success",
                "return",
                format!(
                    ", {} -> {} turns per episode{tools}",
                    tb.value(),
                    ta.value()
                ),
                "greedy success",
            ),
            _ => (
                "prompts",
                "pass@1",
                "reward",
                String::new(),
                "greedy accuracy",
            ),
        };
        format!(
            "Held-out ({} {unit}): {pass} at temperature {} {} -> {} (gain {:+.1} points, \
             standard error {:.1}), {reward} {} -> {}{turns}; {greedy} {} -> {}. ",
            a.prompts,
            a.temperature,
            b.pass_at_1.percent(),
            a.pass_at_1.percent(),
            100.0 * gain.mean,
            100.0 * gain.se,
            b.reward.value(),
            a.reward.value(),
            b.greedy_accuracy.percent(),
            a.greedy_accuracy.percent(),
        )
    }
}

/// What a finished run measured, for [`summarize`].
pub(super) struct RunFacts<'a> {
    pub(super) bus: &'static str,
    pub(super) namespace: &'a str,
    pub(super) params: usize,
    pub(super) warm_start_s: f64,
    pub(super) wall_s: f64,
    pub(super) rows: &'a [StepRow],
    pub(super) train: &'a TrainSummary,
    pub(super) generator: &'a GenSummary,
    /// Held-out evaluations, in step order.
    pub(super) held_out: Vec<HeldOut>,
    /// Prompts fed, and of them fed again.
    pub(super) fed: (u64, u64),
}

pub(super) fn summarize(opts: &RunOptions, cfg: Config, f: &RunFacts) -> RunSummary {
    let RunFacts {
        bus,
        namespace,
        params,
        warm_start_s,
        wall_s,
        rows,
        train: t,
        generator: g,
        ref held_out,
        fed: (prompts_fed, prompts_reoffered),
    } = *f;
    let (reward_start, reward_end) = start_end(rows, |r| r.record.reward_mean);
    let (accuracy_start, accuracy_end) = start_end(rows, |r| r.record.accuracy);
    let mut stalls = g.decode.swap_stalls.clone();
    stalls.sort_by(f64::total_cmp);
    let mut staleness = BTreeMap::new();
    for h in &t.history {
        for &s in &h.staleness {
            *staleness.entry(s).or_default() += 1;
        }
    }
    let trained_tokens: u64 = t.history.iter().map(|h| h.tokens).sum();
    RunSummary {
        mode: if opts.sync { "sync" } else { "async" }.into(),
        task: opts.prompts.name(),
        bus: bus.into(),
        namespace: namespace.into(),
        model_params: params,
        warm_start_s,
        steps: t.steps,
        wall_s,
        trained_groups: t.trained_groups,
        trained_tokens,
        trained_tokens_per_s: trained_tokens as f64 / wall_s.max(1e-9),
        generated_groups: g.groups,
        generated_tokens: g.tokens,
        served_tokens: match cfg.generator.serve {
            Some(_) => g.decode.tokens.saturating_sub(g.tokens),
            None => 0,
        },
        prompts_fed,
        prompts_reoffered,
        reward_start,
        reward_end,
        accuracy_start,
        accuracy_end,
        pass_at_1_gain: match (held_out.first(), held_out.last()) {
            (Some(b), Some(a)) if held_out.len() > 1 => {
                Some(a.eval.pass_at_1.minus(&b.eval.pass_at_1).within(-1.0, 1.0))
            }
            _ => None,
        },
        held_out: held_out.clone(),
        gen_idle_fraction: (g.decode.idle_s / wall_s.max(1e-9)).min(1.0),
        gen_busy_s: g.decode.busy_s,
        gen_idle_s: g.decode.idle_s,
        train_busy_s: t.history.iter().map(|h| h.step_s).sum(),
        train_wait_s: t.history.iter().map(|h| h.wait_s).sum(),
        swaps: g.decode.swaps,
        swap_stall_p50_s: percentile(&stalls, 0.5),
        swap_stall_p99_s: percentile(&stalls, 0.99),
        swap_stall_max_s: stalls.last().copied().unwrap_or(0.0),
        staleness,
        dropped: t.dropped.clone(),
        config: cfg,
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Mean of `f` over the first and the last tenth of `rows` (1 to 10 rows each).
fn start_end(rows: &[StepRow], f: impl Fn(&StepRow) -> f64) -> (f64, f64) {
    if rows.is_empty() {
        return (0.0, 0.0);
    }
    let k = (rows.len() / 10).clamp(1, 10);
    let mean = |r: &[StepRow]| r.iter().map(&f).sum::<f64>() / r.len() as f64;
    (mean(&rows[..k]), mean(&rows[rows.len() - k..]))
}
