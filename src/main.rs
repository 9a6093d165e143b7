//! The `rlstream` binary: parse, set up logging and the runtime, dispatch. Each command's
//! flags and work live in [`rlstream::cli`].

use anyhow::Context;
use rlstream::cli::Cli;
use std::io::IsTerminal;
use std::process::ExitCode;

/// Tensor buffers are allocated and freed by the thousand per training step; glibc's
/// allocator hands large ones back to the kernel each time, and the page faults cost about
/// a fifth of a small model's step (BENCHMARKS.md). mimalloc itself hands back memory that
/// stays free for a second; `train.keep_freed_memory` (or `MIMALLOC_PURGE_DELAY=-1`) keeps
/// it, trading resident memory for fewer page faults (BENCHMARKS.md, "Keeping freed memory").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // SAFETY: the first thing the process does; no other thread runs yet.
    unsafe {
        rlstream::collective::divide_cores();
        rlstream::collective::choose_mpi_algorithms();
    }
    rlstream::cpu::select_blas_kernels();
    let cli = Cli::try_parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| cli.command.default_log_filter().into()),
        )
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let done = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|rt| rt.block_on(cli.command.exec()));
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", rlstream::cli::report(&e));
            ExitCode::FAILURE
        }
    }
}
