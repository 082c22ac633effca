use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = timeoutd::cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(timeoutd::commands::dispatch(cli));
    // Everything owed was done or given up inside `dispatch`; a blocking thread still at
    // work (a name lookup for a host that does not answer) must not hold up the exit, as
    // dropping the runtime would.
    runtime.shutdown_background();
    code
}
