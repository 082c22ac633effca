//! `timeoutd pending`: counts and a peek at expectations; read-only.

use std::process::ExitCode;

use anyhow::Context;

use crate::cli::PendingArgs;
use crate::config::Settings;
use crate::store::{PendingFilter, PendingRow, Store};

pub async fn pending(settings: &Settings, args: PendingArgs) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.postgres)?;
    let counts = store
        .pending_counts(settings.election.tick)
        .await
        .context("counting expectations")?;
    let filter = match (args.list, args.failing) {
        (_, true) => Some(PendingFilter::Failing),
        (true, _) => Some(PendingFilter::All),
        _ => None,
    };
    let rows = match filter {
        Some(f) => store
            .list(f, args.limit)
            .await
            .context("listing expectations")?,
        None => Vec::new(),
    };
    store.close().await;
    if args.json {
        let out = serde_json::json!({ "counts": counts, "rows": filter.map(|_| &rows) });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "pending {}  due {}  overdue {}  failing {}",
            counts.pending, counts.due, counts.overdue, counts.failing
        );
        rows.iter().for_each(print_row);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_row(r: &PendingRow) {
    println!(
        "{}  {}  {}  {}  exchange={:?} key={:?} attempts={}{}{}",
        r.id,
        r.timeout_at.to_rfc3339(),
        r.process_id,
        r.message_type,
        r.exchange,
        r.routing_key,
        r.attempts,
        if r.parked { " PARKED" } else { "" },
        r.last_error
            .as_ref()
            .map(|e| format!(" last_error={e:?}"))
            .unwrap_or_default()
    );
}
