//! `timeoutd pending`: counts and a peek at expectations and delayed messages; read-only.

use std::process::ExitCode;

use anyhow::Context;

use super::print_json;
use crate::cli::PendingArgs;
use crate::config::Settings;
use crate::store::{Kind, PendingDelayed, PendingFilter, PendingRow, Store};
use crate::telemetry::Shown;

/// The rows `args` asks to list (`None`: counts only). Any filter lists.
fn filter(args: &PendingArgs) -> Option<PendingFilter> {
    let filter = PendingFilter {
        kind: args.kind,
        process_id: args.process_id.clone(),
        message_type: args.message_type.clone(),
        owner: args.owner.clone(),
        message_id: args.message_id.clone(),
        failing: args.failing,
        held: args.held,
    };
    (args.list || filter != PendingFilter::default()).then_some(filter)
}

pub async fn pending(settings: &Settings, args: PendingArgs) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.postgres)?;
    let late = settings.election.tick;
    let counts = store
        .pending_counts(late)
        .await
        .context("counting expectations")?;
    let delayed = store
        .counts(Kind::Delayed, late)
        .await
        .context("counting delayed messages")?;
    let filter = filter(&args);
    let (rows, delayed_rows) = match &filter {
        Some(f) => (
            store
                .list(f, args.limit)
                .await
                .context("listing expectations")?,
            store
                .list_delayed(f, args.limit)
                .await
                .context("listing delayed messages")?,
        ),
        None => (Vec::new(), Vec::new()),
    };
    store.close().await;
    if args.json {
        let out = serde_json::json!({
            "counts": counts,
            "rows": filter.as_ref().map(|_| &rows),
            "delayed": { "counts": delayed, "rows": filter.as_ref().map(|_| &delayed_rows) },
        });
        print_json(&out)?;
    } else {
        for (kind, c) in [("expectations", counts), ("delayed     ", delayed)] {
            println!(
                "{kind}  pending {}  due {}  overdue {}  failing {}",
                c.pending, c.due, c.overdue, c.failing
            );
        }
        rows.iter().for_each(print_row);
        delayed_rows.iter().for_each(print_delayed);
    }
    Ok(ExitCode::SUCCESS)
}

fn last_error(e: &Option<String>) -> String {
    e.as_ref()
        .map(|e| format!(" last_error={e:?}"))
        .unwrap_or_default()
}

/// Row data may hold anything a publisher or a process manager wrote: bare fields go
/// through `Shown`, quoted ones through `Debug`, which escapes the same characters.
fn print_row(r: &PendingRow) {
    println!(
        "expectation {}  {}  {}  {}  exchange={:?} key={:?} attempts={}{}{}",
        r.id,
        r.timeout_at.to_rfc3339(),
        Shown(&r.process_id),
        Shown(&r.message_type),
        r.exchange,
        r.routing_key,
        r.attempts,
        if r.parked { " PARKED" } else { "" },
        last_error(&r.last_error)
    );
}

fn print_delayed(r: &PendingDelayed) {
    println!(
        "delayed {}  {}  owner={:?} message_id={:?}  exchange={:?} key={:?} bytes={} attempts={}{}{}",
        r.id,
        r.deliver_at.to_rfc3339(),
        r.owner,
        r.message_id,
        r.exchange,
        r.routing_key,
        r.body_bytes,
        r.attempts,
        if r.held { " HELD" } else { "" },
        last_error(&r.last_error)
    );
}
