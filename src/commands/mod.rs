//! One function per command of the contract; `main` only parses and dispatches.

mod hint;
mod members;
mod pending;
mod run;
mod verbs;

use std::process::ExitCode;

use anyhow::Context;

use crate::cli::{Cli, Command, ExpectArgs};
use crate::client::{self, Expectation};
use crate::config::{ConfigError, Settings};
use crate::store::Store;
use crate::telemetry::{self, Chain, Shown, Spelling, escape};

/// Exit code of a refused configuration.
pub const EXIT_CONFIG: u8 = 2;
/// Exit code when the node lagged for too long and wants to be restarted.
pub const EXIT_LAGGING: u8 = 3;
/// Exit code of a verb (`cancel`, `reschedule`, `release`, `retry`) when the row is not
/// in the state the verb needs: not pending (already fired or delivered, cancelled
/// before, or never stored), and for `release` not parked or held, for `retry` not
/// waiting for a retry.
pub const EXIT_NOT_PENDING: u8 = 4;
/// Exit code of `run` when the stop gave up on something it waits for (a batch in flight,
/// the `leaving` announcement, closing a connection) because a peer did not answer in time.
pub const EXIT_ABANDONED: u8 = 5;
/// Exit code of `members --once` when no member answered (none running in the group,
/// or they cannot be heard: another vhost, exchange or group name).
pub const EXIT_NOBODY: u8 = 6;
/// Exit code of a verb the database refused: `release` of a delayed message stored
/// without its body (it can only be cancelled), or a role that may not call the SQL API
/// functions or act on another owner's delayed messages.
pub const EXIT_REFUSED: u8 = 7;

/// Every exit code and what it means, as `timeoutd --help` shows them.
pub const EXIT_CODES: [(u8, &str); 8] = [
    (0, "done; `run`: stopped on SIGTERM/SIGINT"),
    (
        1,
        "failed (the error is printed on stderr, with a hint for common mistakes)",
    ),
    (
        EXIT_CONFIG,
        "invalid configuration (the message names the key) or command line",
    ),
    (
        EXIT_LAGGING,
        "`run`: lagged for longer than election.max_lag_exit; restart it",
    ),
    (
        EXIT_NOT_PENDING,
        "`cancel`, `reschedule`: not pending; `release`: not parked or held; `retry`: not \
         waiting for a retry",
    ),
    (
        EXIT_ABANDONED,
        "`run`: the stop gave up on what a peer did not answer within shutdown.grace",
    ),
    (EXIT_NOBODY, "`members --once`: no member answered"),
    (
        EXIT_REFUSED,
        "`cancel`, `reschedule`, `release`, `retry`: refused by the database (a message \
         stored without its body; a role without the right)",
    ),
];

/// The exit codes as help text.
pub fn exit_codes_help() -> String {
    EXIT_CODES
        .iter()
        .fold(String::from("Exit codes:\n"), |text, (code, meaning)| {
            text + &format!("  {code}  {meaning}\n")
        })
}

/// The settings a command runs with, loaded before the async runtime starts (they say
/// how many threads it has); refused ones end the command with their exit code.
pub fn settings(cli: &Cli) -> Result<Settings, ExitCode> {
    Settings::load(cli.config.as_deref()).map_err(|e| config_error(&e))
}

/// Run the command `cli` names with `settings` (see [`settings`]).
pub async fn dispatch(cli: Cli, settings: Settings) -> ExitCode {
    let daemon = matches!(cli.command, Command::Run);
    telemetry::init(settings.log.format, daemon);
    let result = match cli.command {
        Command::Run => run::run(settings.clone()).await,
        Command::Migrate(args) => migrate(&settings, args.json).await,
        Command::CheckConfig(args) => check_config(&settings, args.json),
        Command::Expect(args) => expect(&settings, args).await,
        Command::Members(args) => members::members(&settings, args).await,
        Command::Pending(args) => pending::pending(&settings, args).await,
        Command::Cancel(args) => verbs::cancel(&settings, args).await,
        Command::Reschedule(args) => verbs::reschedule(&settings, args).await,
        Command::Release(args) => verbs::release(&settings, args).await,
        Command::Retry(args) => verbs::retry(&settings, args).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            report(&e, hint::hint(&e, &settings), daemon);
            ExitCode::FAILURE
        }
    }
}

/// The error that ends a command, once: the daemon logs it (its stderr is a log, maybe
/// JSON), the other commands print `error: …` as command line tools do.
fn report(e: &anyhow::Error, hint: Option<String>, daemon: bool) {
    let error = Chain(&**e).to_string();
    if daemon {
        match hint {
            Some(hint) => tracing::error!(hint, "{error}"),
            None => tracing::error!("{error}"),
        }
        return;
    }
    eprintln!("error: {}", Shown(&error));
    if let Some(hint) = hint {
        eprintln!("hint: {}", Shown(&hint));
    }
}

fn config_error(e: &ConfigError) -> ExitCode {
    eprintln!("error: {}", Shown(&e.to_string()));
    ExitCode::from(EXIT_CONFIG)
}

/// Print one JSON document on stdout, row data escaped (see `telemetry::Spelling`): what
/// every command's `--json` prints.
pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(value).context("printing JSON")?;
    println!("{}", escape(&json, Spelling::Unicode));
    Ok(())
}

async fn migrate(settings: &Settings, json: bool) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.postgres)?;
    store
        .migrate_for(settings, "timeoutd migrate")
        .await
        .context("applying migrations")?;
    if json {
        print_json(&serde_json::json!({ "migrated": true, "schema": store.schema() }))?;
    } else {
        println!("migrations applied to schema {}", store.schema());
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

fn check_config(settings: &Settings, json: bool) -> anyhow::Result<ExitCode> {
    // Passwords are redacted by the URL type itself.
    if json {
        print_json(&serde_json::json!({ "valid": true, "settings": settings }))?;
        return Ok(ExitCode::SUCCESS);
    }
    let shown = toml::to_string(settings).context("printing the settings as TOML")?;
    println!(
        "# configuration is valid\n{}",
        escape(&shown, Spelling::Unicode)
    );
    Ok(ExitCode::SUCCESS)
}

async fn expect(settings: &Settings, args: ExpectArgs) -> anyhow::Result<ExitCode> {
    let mut e = Expectation::new(&args.process_id, &args.message_type, &args.routing_key)
        .exchange(&args.exchange);
    if let Some(at) = args.at {
        e = e.due_at(at);
    } else if let Some(after) = args.in_ {
        e = e.due_in(after);
    }
    if let Some(p) = args.payload {
        e = e.payload(p);
    }
    let store = Store::connect(&settings.postgres)?;
    let mut conn = store
        .pool()
        .acquire()
        .await
        .context("connecting to Postgres")?;
    let id = client::expect(&mut conn, store.schema(), &e)
        .await
        .context("inserting the expectation")?;
    if args.json {
        print_json(&serde_json::json!({ "id": id, "timeout_at": e.timeout_at.to_rfc3339() }))?;
    } else {
        println!("{id} due at {}", e.timeout_at.to_rfc3339());
    }
    drop(conn);
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::EXIT_CODES;

    /// The users' table of exit codes (docs/operating/running.md) lists exactly the
    /// codes the program has.
    #[test]
    fn the_documented_exit_codes_are_the_programs() {
        let page = include_str!("../../docs/operating/running.md");
        let table = page
            .split("## Exit codes")
            .nth(1)
            .expect("an \"Exit codes\" section");
        let documented: Vec<u8> = table
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.split('|').nth(1)?.trim().parse().ok())
            .collect();
        let ours: Vec<u8> = EXIT_CODES.iter().map(|(code, _)| *code).collect();
        assert_eq!(documented, ours, "docs/operating/running.md, Exit codes");
    }
}
