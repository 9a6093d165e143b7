//! What the commands that talk to the bus share: the config file flag over the connection
//! settings, resolving the layers, connecting, and the shutdown signal.

use crate::bus::{RedisBus, RedisOptions, Resilient, SharedBus, TlsFiles, Topology};
use crate::config::{CommonArgs, Config};
use crate::roles::Stage;
use anyhow::Result;
use std::path::PathBuf;
use std::sync::Arc;

/// Flags every bus command takes: the config file and the connection settings.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct StageArgs {
    /// TOML config file (top-level connection keys; sections [feed], [policy], [gen],
    /// [score], [train], [weights], [run]; every key: docs/settings.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl StageArgs {
    /// The config from `base` (a command's own defaults), the file, `env`, these flags and
    /// then `flags` (the command's section flags, already layered).
    pub fn resolve(
        &self,
        base: toml::Table,
        env: impl Iterator<Item = (String, String)>,
        flags: impl IntoIterator<Item = toml::Table>,
    ) -> Result<Config> {
        let mut layer = self.common.layer();
        for f in flags {
            layer.extend(f);
        }
        Ok(Config::resolve(base, self.config.as_deref(), env, layer)?)
    }
}

/// The topology the config names, with `namespace` and `archive_dir` applied when set.
pub fn topology(cfg: &Config) -> Result<Topology> {
    let topo = match &cfg.topology {
        Some(p) => Topology::load(p)?,
        None => Topology::default(),
    };
    let mut topo = match &cfg.namespace {
        Some(ns) => topo.with_namespace(ns)?,
        None => topo,
    };
    if let Some(dir) = &cfg.archive_dir {
        topo.archive_dir = Some(dir.clone());
    }
    if cfg.redis_stop_on_data_loss {
        topo.on_data_loss = crate::bus::OnDataLoss::Stop;
    }
    Ok(topo)
}

/// Starts the metrics listener when the config asks for one.
pub fn serve_metrics(cfg: &Config) -> Result<()> {
    if let Some(addr) = &cfg.metrics_addr {
        let served = crate::metrics::install(addr)?;
        tracing::info!("serving metrics at http://{served}/metrics");
    }
    Ok(())
}

/// Redis, with retries through outages for `redis_patience_s` (see [`Resilient`]). A
/// Redis that cannot be reached at start is an error at once.
pub async fn connect_redis(url: &str, cfg: &Config) -> Result<SharedBus> {
    let opts = RedisOptions {
        tls: TlsFiles {
            ca: cfg.redis_tls_ca.clone(),
            cert: cfg.redis_tls_cert.clone(),
            key: cfg.redis_tls_key.clone(),
        },
        ..RedisOptions::default()
    };
    let redis: SharedBus = Arc::new(RedisBus::connect_with(url, opts).await?);
    let patience = std::time::Duration::from_secs(cfg.redis_patience_s);
    Ok(Arc::new(Resilient::new(redis, patience)))
}

/// The metrics listener, the topology and Redis for a resolved config; with metrics on,
/// `stage` also exports the streams' length, pending and lag.
pub async fn connect(cfg: &Config, stage: Stage) -> Result<(Topology, SharedBus)> {
    serve_metrics(cfg)?;
    let topo = topology(cfg)?;
    let bus = connect_redis(cfg.redis_url(), cfg).await?;
    if cfg.metrics_addr.is_some() {
        crate::bus::watch_streams(bus.clone(), topo.clone(), stage);
    }
    Ok((topo, bus))
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("stopping: finishing the work in hand");
}

/// A spinner with a running count on a terminal (hidden otherwise).
pub fn counter_bar(verb: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new_spinner();
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{{spinner}} {verb} {{msg}}: {{pos}} entries"
    )) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// `--from` / `--to`: an inclusive bound at an id or time (see
/// [`crate::commands::replay::parse_point`]), or open when not given.
pub fn point_bound(point: Option<&str>) -> Result<crate::bus::RangeBound> {
    use crate::bus::RangeBound;
    Ok(point
        .map(crate::commands::replay::parse_point)
        .transpose()?
        .map_or(RangeBound::Open, RangeBound::Inclusive))
}

/// Topology, bus and config for a command with no settings section of its own.
pub async fn plain_connect(
    args: &StageArgs,
    stage: Stage,
) -> Result<(Config, Topology, SharedBus)> {
    let cfg = args.resolve(toml::Table::new(), std::env::vars(), [])?;
    let (topo, bus) = connect(&cfg, stage).await?;
    Ok((cfg, topo, bus))
}

/// Joins the trainer ranks this process is one of (`mpirun -n N`, or NCCL ranks from
/// `--world`/`--rank` or a launcher's environment; see [`crate::collective::plan`]). Rank 0
/// gets the ranks its trainer stage leads and runs its command (a process alone gets one
/// rank, itself); any other rank follows rank 0's trainer (comparing its settings, `own`,
/// with rank 0's when it has them) and gets `None` once rank 0 stops.
pub async fn join_ranks(
    cfg: &Config,
    own: Option<&crate::stages::train::TrainerSettings>,
) -> anyhow::Result<Option<Box<dyn crate::collective::Collective>>> {
    // `run` takes its settings from rank 0 (`own` is `None`) and may pick a fresh namespace:
    // its ranks meet only through mpirun.
    let nccl_allowed = own.is_some();
    use crate::collective::{self, Plan};
    let t = &cfg.train;
    let rendezvous = t.rendezvous.as_deref().unwrap_or_default();
    let plan = collective::plan(t.collective, t.world, t.rank, rendezvous, |v| {
        std::env::var(v).ok()
    })?;
    let alone = || {
        Ok(Some(
            Box::new(collective::Solo::default()) as Box<dyn collective::Collective>
        ))
    };
    let c = match plan {
        Plan::Alone => return alone(),
        Plan::Mpi => match collective::join_mpi()? {
            Some(c) => c,
            None => return alone(),
        },
        Plan::Nccl(_) if !nccl_allowed => anyhow::bail!(
            "`rlstream run` runs trainer ranks under mpirun only (a build with --features mpi); \
             NCCL ranks run `rlstream train` on Redis"
        ),
        Plan::Nccl(p) => {
            if cfg.redis.is_none() {
                anyhow::bail!(
                    "NCCL trainer ranks meet through Redis: give --redis (on the embedded bus, \
                     run the ranks under mpirun)"
                );
            }
            let (topo, bus) = connect(cfg, Stage::Train).await?;
            let timeout = std::time::Duration::from_secs_f64(t.collective_timeout_s * 10.0);
            collective::join_nccl(&p, bus.as_ref(), &topo.namespace, timeout).await?
        }
    };
    if t.world > 0 && t.world != c.world() {
        anyhow::bail!(
            "--world {} but the launcher started {} ranks: give one world size",
            t.world,
            c.world()
        );
    }
    if c.rank() == 0 {
        return Ok(Some(c));
    }
    // rank 0 alone answers signals: it checkpoints and then tells the others to stop.
    tokio::spawn(async {
        loop {
            shutdown_signal().await;
            tracing::info!("signal ignored: trainer rank 0 stops every rank after its checkpoint");
        }
    });
    tokio::task::block_in_place(|| crate::stages::train::follow(c, own))?;
    Ok(None)
}
