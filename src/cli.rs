//! The command line (clap derive): the commands of the contract and their flags.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{ArgGroup, Args, Parser, Subcommand};
use uuid::Uuid;

use crate::kind::Kind;

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
    Migrate(JsonArgs),
    /// Validate the configuration and print it with secrets redacted.
    CheckConfig(JsonArgs),
    /// Register one expectation (for trying things out and for scripts).
    Expect(ExpectArgs),
    /// Watch the group: who is there, who is active, last seen, announcement lag (exit 6
    /// with --once when no member answered).
    Members(MembersArgs),
    /// Count and peek at expectations and delayed messages (never changes them).
    Pending(PendingArgs),
    /// Cancel a pending expectation (by id, or every one of a process) or delayed message
    /// (exit 4: not pending).
    Cancel(CancelArgs),
    /// Move the deadline of a pending expectation or delayed message (exit 4: not
    /// pending).
    Reschedule(RescheduleArgs),
    /// Fire a parked expectation, or judge a held delayed message again and deliver it,
    /// now (exit 4: not parked or held; 7: a message stored without its body).
    Release(VerbArgs),
    /// Try now what waits for its next attempt after a failed publish (exit 4: not
    /// waiting for a retry).
    Retry(VerbArgs),
}

/// Just `--json`.
#[derive(Debug, Args)]
pub struct JsonArgs {
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Which row a verb acts on: an expectation by its id, or a delayed message by its
/// message_id and owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Expectation(Uuid),
    Delayed { message_id: String, owner: String },
}

/// The row a verb acts on, as given on the command line (one of `--id`,
/// `--message-id`: see the commands' argument groups).
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// The expectation's id (as `expect` printed it; its TimeOut's message_id).
    #[arg(long)]
    pub id: Option<Uuid>,
    /// The delayed message's message_id (as published, or given at ingest).
    #[arg(long)]
    pub message_id: Option<String>,
    /// With --message-id: its owner, the AMQP user_id it was published with ("" =
    /// anonymous, published without one; sql:ROLE for one the SQL API stored).
    #[arg(long, default_value = "", requires = "message_id")]
    pub owner: String,
}

impl TargetArgs {
    /// `None` when neither `--id` nor `--message-id` was given.
    pub fn target(&self) -> Option<Target> {
        match (&self.id, &self.message_id) {
            (Some(id), _) => Some(Target::Expectation(*id)),
            (None, Some(m)) => Some(Target::Delayed {
                message_id: m.clone(),
                owner: self.owner.clone(),
            }),
            (None, None) => None,
        }
    }
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("target").required(true).args(["id", "message_id"])))]
pub struct VerbArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("target").required(true).args(["id", "process_id", "message_id"])))]
pub struct CancelArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Every pending expectation of this process instance.
    #[arg(long)]
    pub process_id: Option<String>,
    /// With --process-id: only its expectations of this message type.
    #[arg(long, requires = "process_id")]
    pub message_type: Option<String>,
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("target").required(true).args(["id", "message_id"])))]
#[command(group(ArgGroup::new("when").required(true).args(["in_", "at"])))]
pub struct RescheduleArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// The new deadline relative to the database's clock, e.g. 5s, 2m.
    #[arg(long = "in", value_parser = humantime::parse_duration)]
    pub in_: Option<Duration>,
    /// The new deadline, RFC 3339 (e.g. 2030-01-01T12:00:00Z).
    #[arg(long)]
    pub at: Option<DateTime<Utc>>,
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
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
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
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
    /// List the pending rows, earliest deadline first (any filter below lists too).
    #[arg(long)]
    pub list: bool,
    /// List the rows whose publish failed (attempts > 0; held and parked ones included),
    /// with their last error.
    #[arg(long)]
    pub failing: bool,
    /// List only parked expectations and held delayed messages (waiting for an
    /// operator: `release` or `cancel`).
    #[arg(long)]
    pub held: bool,
    /// List only rows of this kind.
    #[arg(long, value_enum)]
    pub kind: Option<Kind>,
    /// List only expectations of this process instance.
    #[arg(long, conflicts_with_all = ["owner", "message_id"])]
    pub process_id: Option<String>,
    /// List only expectations of this message type.
    #[arg(long, conflicts_with_all = ["owner", "message_id"])]
    pub message_type: Option<String>,
    /// List only delayed messages of this owner ("" = anonymous).
    #[arg(long)]
    pub owner: Option<String>,
    /// List only delayed messages with this message_id.
    #[arg(long)]
    pub message_id: Option<String>,
    /// JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// At most this many rows of each kind when listing.
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
