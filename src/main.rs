use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = timeoutd::cli::Cli::parse();
    timeoutd::commands::dispatch(cli).await
}
