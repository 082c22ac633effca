use std::process::ExitCode;

use clap::Parser;

/// glibc's allocator was a fifth of the daemon's CPU in a burst (`perf`: malloc, free and
/// their consolidation, for every message's frames, properties and futures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = timeoutd::cli::Cli::parse();
    timeoutd::commands::dispatch(cli).await
}
