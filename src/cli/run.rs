//! `rlstream run`.

use super::common::{StageArgs, connect_redis, serve_metrics, shutdown_signal, topology};
use crate::bus::{MemoryBus, SharedBus};
use crate::commands::run::{self, DatasetSource, RunOptions, RunPrompts};
use crate::commands::sft::SftOptions;
use crate::config::{Config, DifficultyArgs, GenArgs, PolicyArgs, RunArgs, ScoreArgs, TrainArgs};
use crate::display::DisplayMode;
use crate::roles::Stage;
use crate::settings::{Section, doc_of, flag_id, with_default};
use anyhow::Result;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct RunCommand {
    #[command(flatten)]
    stage: StageArgs,
    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    policy: PolicyArgs,
    #[command(flatten)]
    generator: GenArgs,
    #[command(flatten)]
    score: ScoreArgs,
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    difficulty: DifficultyArgs,
}

/// `run` as its help should read: its own defaults (a layer over the stages') in the help,
/// and the settings `run` decides itself (consumer names, the checkpoint directory under
/// `--out`) out of the way.
pub fn adjust(mut cmd: clap::Command) -> clap::Command {
    let defaults = run::defaults_layer(crate::config::RunConfig::default().task);
    for (section, table) in &defaults {
        let Some(table) = table.as_table() else {
            continue;
        };
        for (key, value) in table {
            let id = flag_id(section, key);
            let default_task = crate::config::RunConfig::default().task.name();
            let shown = match (section.as_str(), key.as_str()) {
                ("gen", "max_new_tokens") => toml::Value::String(format!(
                    "{value} for --task {default_task}; the task's longest answer + 2"
                )),
                ("train", "lr") => toml::Value::String(format!(
                    "{value} for a built-in task; {} with --dataset",
                    run::DATASET_LR
                )),
                ("run", "sft_steps") => toml::Value::String(format!(
                    "{value} for --task {default_task}; 300 for guess, 1500 for calc, 100 for \
                     the others"
                )),
                ("train", "steps") => toml::Value::String(format!(
                    "{value} for --task {default_task}; 200 for the others and --dataset"
                )),
                _ => value.clone(),
            };
            cmd = cmd.mut_arg(id, |a| {
                let doc = a.get_help().map(|h| doc_of(&h.to_string()).to_string());
                a.help(with_default(&doc.unwrap_or_default(), Some(&shown)))
            });
        }
    }
    for section in [
        crate::config::GenConfig::NAME,
        crate::config::ScoreConfig::NAME,
        crate::config::TrainConfig::NAME,
    ] {
        cmd = cmd.mut_arg(flag_id(section, "name"), |a| {
            a.long(format!("{section}-name")).hide(true)
        });
    }
    cmd.mut_arg(
        flag_id(crate::config::TrainConfig::NAME, "checkpoint_dir"),
        |a| a.hide(true),
    )
}

impl RunCommand {
    fn layers(&self) -> [toml::Table; 6] {
        [
            self.run.layer(),
            self.policy.layer(),
            self.generator.layer(),
            self.score.layer(),
            self.train.layer(),
            self.difficulty.layer(),
        ]
    }

    pub fn config(&self, env: impl Iterator<Item = (String, String)>) -> Result<Config> {
        let env: Vec<(String, String)> = env.collect();
        // The task decides one default (the completion length): resolve it first.
        let first = self.stage.resolve(
            run::defaults_layer(crate::config::RunConfig::default().task),
            env.iter().cloned(),
            self.layers(),
        )?;
        let defaults = match first.run.dataset {
            Some(_) => run::dataset_defaults_layer(),
            None => run::defaults_layer(first.run.task),
        };
        self.stage.resolve(defaults, env.into_iter(), self.layers())
    }

    /// What the run is asked to do, from the resolved settings; a refusal for settings
    /// that cannot make a run.
    fn options(&self, cfg: &Config) -> Result<RunOptions> {
        let r = &cfg.run;
        if r.dataset.is_some() && self.run.task.is_some() {
            anyhow::bail!("give --task or --dataset, not both");
        }
        if cfg.train.steps == 0 {
            anyhow::bail!(
                "run needs --steps of at least 1 (a run ends after its steps; `rlstream train` \
                 alone runs until stopped with --steps 0)"
            );
        }
        if cfg.generator.group_size < 2
            && cfg.score.distill == crate::stages::score::DistillKind::None
        {
            anyhow::bail!(
                "--group-size 1 trains nothing: each completion's advantage is its reward less \
                 its group's mean, which for a group of one is itself, so every advantage is 0; \
                 use --group-size 2 or more (8 is the default)"
            );
        }
        let prompts = match &r.dataset {
            None => RunPrompts::Task(r.task),
            Some(path) => RunPrompts::Dataset(DatasetSource {
                path: path.clone(),
                columns: crate::tasks::Columns {
                    prompt: r.prompt_column.clone(),
                    answer: r.answer_column.clone(),
                    messages: r.messages_column.clone(),
                },
                eval: r.eval_dataset.clone(),
                held_out_share: r.held_out_share,
            }),
        };
        let out = r
            .out
            .clone()
            .unwrap_or_else(|| run::default_out(&prompts.name()));
        Ok(RunOptions {
            prompts,
            model: cfg.policy.model.clone(),
            sft: SftOptions {
                task: r.task,
                out: out.join("sft"),
                steps: r.sft_steps,
                hidden: r.hidden,
                layers: r.layers,
                experts: r.experts,
                seed: cfg.policy.seed,
                ..SftOptions::default()
            },
            out,
            report: r.report.clone(),
            sync: r.sync,
            seed: cfg.policy.seed,
            display: if r.plain {
                DisplayMode::Log {
                    every: std::time::Duration::from_secs(5),
                }
            } else {
                DisplayMode::auto()
            },
        })
    }

    pub async fn exec(self) -> Result<()> {
        let cfg = self.config(std::env::vars())?;
        cfg.validate()?;
        let opts = self.options(&cfg)?;
        // Under `mpirun -n N`, rank 0 runs the pipeline and the others are its trainer ranks.
        let Some(ranks) = super::common::join_ranks(&cfg, None).await? else {
            return Ok(());
        };
        serve_metrics(&cfg)?;
        let mut topo = topology(&cfg)?;
        let bus: SharedBus = match &cfg.redis {
            Some(url) => {
                let ns = cfg.namespace.clone().unwrap_or_else(run::fresh_namespace);
                topo = topo.with_namespace(&ns)?;
                eprintln!("using Redis at {url}, namespace {ns}");
                connect_redis(url, &cfg).await?
            }
            None => Arc::new(MemoryBus::new()),
        };
        if cfg.metrics_addr.is_some() {
            crate::bus::watch_streams(bus.clone(), topo.clone(), Stage::Run);
        }
        eprintln!("run directory {}", opts.out.display());
        let outcome = run::run(&opts, cfg, bus, topo, ranks, shutdown_signal()).await?;
        println!("{}", outcome.summary.paragraph());
        let report = outcome.report.map_err(|e| {
            anyhow::anyhow!(
                "{e}. The run itself finished (its summary is above; the model and checkpoints \
                 under {} are whole, and a report that was there before is left whole): free \
                 space, or write the report elsewhere with --report DIR, and run again",
                opts.out.display()
            )
        })?;
        println!(
            "learning curve: {}\nper-step metrics: {} and {}\nsummary: {}",
            report.svg.display(),
            report.jsonl.display(),
            report.csv.display(),
            report.summary.display()
        );
        Ok(())
    }
}
