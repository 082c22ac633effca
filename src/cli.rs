//! The command line (clap derive): the commands of the contract and their flags.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "timeoutd",
    version,
    about = "Fires TimeOut messages for a process manager's overdue expectations"
)]
pub struct Cli {
    /// Configuration file (TOML), layered over the built-in defaults and under the
    /// TIMEOUTD__SECTION__KEY environment variables.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join the group and fire TimeOuts while active, until SIGTERM/SIGINT.
    Run,
    /// Create the schema and apply the embedded migrations, then exit.
    Migrate,
    /// Validate the configuration and print it with secrets redacted.
    CheckConfig,
    /// Register one expectation (for trying things out and for scripts).
    Expect(ExpectArgs),
    /// Watch the group: who is there, who is active, last seen, announcement lag (exit 6
    /// with --once when no member answered).
    Members(MembersArgs),
    /// Count and peek at expectations and delayed messages (never changes them).
    Pending(PendingArgs),
    /// Cancel a pending delayed message by its owner and message_id (exit 4: not pending).
    Cancel(CancelArgs),
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The message_id the delayed message was published with (or was given at ingest).
    #[arg(long)]
    pub message_id: String,
    /// Its owner: the AMQP user_id it was published with ("" = anonymous, published
    /// without one).
    #[arg(long, default_value = "")]
    pub owner: String,
}

#[derive(Debug, Args)]
pub struct ExpectArgs {
    /// The process instance that waits; the TimeOut carries it as its correlation_id.
    #[arg(long)]
    pub process_id: String,
    /// The message the process waits for; the TimeOut names it.
    #[arg(long)]
    pub message_type: String,
    /// Routing key the TimeOut is published with (the process' timeout handler).
    #[arg(long)]
    pub routing_key: String,
    /// Exchange the TimeOut goes to ("" = the default exchange).
    #[arg(long, default_value = "")]
    pub exchange: String,
    /// Deadline relative to now, e.g. 5s, 2m (neither --in nor --at: now).
    #[arg(long = "in", value_parser = humantime::parse_duration, conflicts_with = "at")]
    pub in_: Option<Duration>,
    /// Absolute deadline, RFC 3339 (e.g. 2030-01-01T12:00:00Z).
    #[arg(long)]
    pub at: Option<DateTime<Utc>>,
    /// JSON context echoed back in the TimeOut.
    #[arg(long, value_parser = parse_json)]
    pub payload: Option<serde_json::Value>,
}

#[derive(Debug, Args)]
pub struct MembersArgs {
    /// Print one snapshot and exit (exit 6 when no member answered).
    #[arg(long)]
    pub once: bool,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PendingArgs {
    /// List the pending rows, earliest deadline first.
    #[arg(long, conflicts_with = "failing")]
    pub list: bool,
    /// List the rows whose publish failed (attempts > 0), with their last error.
    #[arg(long)]
    pub failing: bool,
    /// JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// At most this many rows with --list/--failing.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

fn parse_json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// `timeoutd <command> --help` describes every flag and every command.
    #[test]
    fn every_command_and_flag_has_help() {
        let cli = Cli::command();
        cli.clone().debug_assert();
        for cmd in cli.get_subcommands() {
            let name = cmd.get_name();
            assert!(cmd.get_about().is_some(), "{name} has no description");
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                assert!(!help.trim().is_empty(), "{name} --{id} has no help text");
            }
        }
    }
}
