use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use timeoutd::cli::Cli;

/// jemalloc, not the system's allocator: lapin's I/O thread frees what the runtime's
/// worker allocated for every publish, and glibc, once the freeing thread's small cache
/// is full, takes the worker's arena lock for each such free, waking the other thread
/// when they meet. jemalloc batches those frees; the daemon spends about a fifth less
/// CPU per TimeOut (docs/performance.md, "The allocator").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let matches = Cli::command()
        .after_help(timeoutd::commands::exit_codes_help())
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let settings = match timeoutd::commands::settings(&cli) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = settings.runtime.workers() {
        builder.worker_threads(n);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(timeoutd::commands::dispatch(cli, settings));
    // Everything owed was done or given up inside `dispatch`; a blocking thread still at
    // work (a name lookup for a host that does not answer) must not hold up the exit, as
    // dropping the runtime would.
    runtime.shutdown_background();
    code
}
