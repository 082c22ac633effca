//! `timeoutd cancel | reschedule | release | retry`: an operator's verbs on one pending
//! row (or, for `cancel --process-id`, a process's expectations). Each calls its SQL API
//! function through the store (`store/api.rs`), which holds the rule; here only what is
//! printed and the exit code.

use std::process::ExitCode;

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};

use super::{EXIT_NOT_PENDING, EXIT_REFUSED, print_json};
use crate::cli::{CancelArgs, RescheduleArgs, Target, VerbArgs};
use crate::config::Settings;
use crate::store::{Due, Refusal, Store, StoreError};
use crate::telemetry::Shown;

/// What a verb did, for the text line, the JSON document and the exit code.
struct Outcome {
    verb: &'static str,
    /// `expectation` or `delayed`.
    kind: &'static str,
    /// The fields naming what it acted on (`id`; `process_id`, `message_type`;
    /// `message_id`, `owner`), then what it did (`cancelled`, `at`).
    fields: Map<String, Value>,
    done: bool,
    /// The text line: what was done, or why not.
    line: String,
    /// The database's reason, when it refused.
    refused: Option<(Refusal, String)>,
}

impl Outcome {
    fn new(verb: &'static str, kind: &'static str, fields: Value) -> Self {
        Self {
            verb,
            kind,
            fields: match fields {
                Value::Object(m) => m,
                _ => Map::new(),
            },
            done: false,
            line: String::new(),
            refused: None,
        }
    }

    /// Of one target (see [`Target`]).
    fn of(verb: &'static str, target: &Target) -> Self {
        match target {
            Target::Expectation(id) => Self::new(verb, "expectation", json!({ "id": id })),
            Target::Delayed { message_id, owner } => Self::new(
                verb,
                "delayed",
                json!({ "message_id": message_id, "owner": owner }),
            ),
        }
    }

    /// The store's answer judged by `judge` (done or not, the line saying so; it may add
    /// fields), or the database's refusal. Any other error ends the command (exit 1).
    fn answer<T>(
        mut self,
        answer: Result<T, StoreError>,
        judge: impl FnOnce(T, &mut Map<String, Value>) -> (bool, String),
    ) -> anyhow::Result<Self> {
        match answer {
            Ok(t) => (self.done, self.line) = judge(t, &mut self.fields),
            Err(StoreError::Refused(why, e)) => {
                let reason = e
                    .as_database_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned());
                self.refused = Some((why, reason));
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!("{} {}", self.verb, self.kind)));
            }
        }
        Ok(self)
    }

    /// Print it (one JSON document, or the line; a refusal on stderr) and give its exit
    /// code.
    fn print(self, json: bool) -> anyhow::Result<ExitCode> {
        let code = match (&self.refused, self.done) {
            (Some(_), _) => ExitCode::from(EXIT_REFUSED),
            (None, true) => ExitCode::SUCCESS,
            (None, false) => ExitCode::from(EXIT_NOT_PENDING),
        };
        if let Some((why, reason)) = &self.refused {
            eprintln!("error: refused: {}", Shown(reason));
            if *why == Refusal::NotPermitted {
                eprintln!(
                    "hint: the role of postgres.url needs EXECUTE on the SQL API functions \
                     (GRANT <schema>_api TO <role>) and, for another owner's delayed \
                     messages, DELETE on delayed_messages; see SECURITY.md"
                );
            }
        }
        if json {
            let mut doc = Map::new();
            doc.insert("verb".into(), self.verb.into());
            doc.insert("kind".into(), self.kind.into());
            doc.extend(self.fields);
            doc.insert("done".into(), self.done.into());
            if let Some((_, reason)) = self.refused {
                doc.insert("refused".into(), reason.into());
            }
            print_json(&Value::Object(doc))?;
        } else if self.refused.is_none() {
            println!("{}", self.line);
        }
        Ok(code)
    }
}

/// How a target is named in the text lines (row data escaped: `Debug` of a string
/// escapes what `Shown` does).
fn named(target: &Target) -> String {
    match target {
        Target::Expectation(id) => format!("expectation {id}"),
        Target::Delayed { message_id, owner } => format!("{message_id:?} of owner {owner:?}"),
    }
}

/// The target the argument groups guarantee.
fn target(t: Option<Target>) -> anyhow::Result<Target> {
    t.context("give --id (an expectation) or --message-id (a delayed message)")
}

pub async fn cancel(settings: &Settings, args: CancelArgs) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.postgres)?;
    let outcome = match &args.process_id {
        Some(process_id) => cancel_process(&store, process_id, args.message_type.as_deref()).await,
        None => cancel_one(&store, args.target.target()).await,
    };
    store.close().await;
    outcome?.print(args.json)
}

async fn cancel_one(store: &Store, t: Option<Target>) -> anyhow::Result<Outcome> {
    let t = target(t)?;
    let (answer, gone) = match &t {
        Target::Expectation(id) => (store.cancel_expectation(*id).await, "already fired"),
        Target::Delayed { message_id, owner } => (
            store.cancel_delayed(message_id, Some(owner)).await,
            "already delivered",
        ),
    };
    let what = named(&t);
    Outcome::of("cancel", &t).answer(answer, |done, _| match done {
        true => (true, format!("cancelled {what}")),
        false => (
            false,
            format!("not pending: {what} ({gone}, cancelled, or unknown)"),
        ),
    })
}

async fn cancel_process(
    store: &Store,
    process_id: &str,
    message_type: Option<&str>,
) -> anyhow::Result<Outcome> {
    let answer = store.cancel_expectations(process_id, message_type).await;
    let of = match message_type {
        Some(t) => format!("process {process_id:?} of type {t:?}"),
        None => format!("process {process_id:?}"),
    };
    let fields = json!({ "process_id": process_id, "message_type": message_type });
    Outcome::new("cancel", "expectation", fields).answer(answer, |n, fields| {
        fields.insert("cancelled".into(), n.into());
        match n {
            0 => (
                false,
                format!(
                    "not pending: no expectation of {of} (already fired, cancelled, or unknown)"
                ),
            ),
            n => (true, format!("cancelled {n} expectation(s) of {of}")),
        }
    })
}

pub async fn reschedule(settings: &Settings, args: RescheduleArgs) -> anyhow::Result<ExitCode> {
    let due = match (args.at, args.in_) {
        (Some(at), _) => Due::At(at),
        (None, Some(after)) => Due::After(after),
        (None, None) => anyhow::bail!("give --in or --at"),
    };
    let t = target(args.target.target())?;
    let store = Store::connect(&settings.postgres)?;
    let answer = match &t {
        Target::Expectation(id) => store.reschedule_expectation(*id, due).await,
        Target::Delayed { message_id, owner } => {
            store.reschedule_delayed(message_id, due, Some(owner)).await
        }
    };
    store.close().await;
    let what = named(&t);
    let outcome = Outcome::of("reschedule", &t).answer(
        answer,
        |at: Option<DateTime<Utc>>, fields| match at {
            Some(at) => {
                fields.insert("at".into(), at.to_rfc3339().into());
                (true, format!("rescheduled {what} to {}", at.to_rfc3339()))
            }
            None => (
                false,
                format!("not pending: {what} (already fired or delivered, cancelled, or unknown)"),
            ),
        },
    )?;
    outcome.print(args.json)
}

pub async fn release(settings: &Settings, args: VerbArgs) -> anyhow::Result<ExitCode> {
    let t = target(args.target.target())?;
    let store = Store::connect(&settings.postgres)?;
    let answer = match &t {
        Target::Expectation(id) => store.release_expectation(*id).await,
        Target::Delayed { message_id, owner } => {
            store.release_delayed(message_id, Some(owner)).await
        }
    };
    store.close().await;
    let (what, state, done) = match &t {
        Target::Expectation(_) => (named(&t), "parked", "it fires again now"),
        Target::Delayed { .. } => (
            named(&t),
            "held",
            "it is judged again and delivered now if it may be",
        ),
    };
    let outcome = Outcome::of("release", &t).answer(answer, |released, _| match released {
        true => (true, format!("released {what}: {done}")),
        false => (false, format!("not {state}: {what} (see pending --held)")),
    })?;
    outcome.print(args.json)
}

pub async fn retry(settings: &Settings, args: VerbArgs) -> anyhow::Result<ExitCode> {
    let t = target(args.target.target())?;
    let store = Store::connect(&settings.postgres)?;
    let answer = match &t {
        Target::Expectation(id) => store.retry_expectation(*id).await,
        Target::Delayed { message_id, owner } => store.retry_delayed(message_id, Some(owner)).await,
    };
    store.close().await;
    let what = named(&t);
    let outcome = Outcome::of("retry", &t).answer(answer, |retried, _| match retried {
        true => (true, format!("retrying {what} now (once due)")),
        false => (
            false,
            format!(
                "not waiting for a retry: {what} (no failed publish to retry, held or parked, \
                 or not pending; see pending --failing)"
            ),
        ),
    })?;
    outcome.print(args.json)
}
