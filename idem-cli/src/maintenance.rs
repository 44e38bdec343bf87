//! `idem purge`, `idem migrate`, `idem verify`: the dedup schema and its
//! retention.

use std::time::Duration;

use idem_runtime::retention::expiry;
use idem_runtime::schema;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sqlx::PgPool;

use crate::output::{CliError, Report, retention};

/// `idem purge`: one run of the retention purge, with a spinner while it
/// runs (a `DETACH ... CONCURRENTLY` waits for transactions that may use
/// the generation).
pub async fn purge(pool: &PgPool) -> Result<Report, CliError> {
    let spinner = ProgressBar::new_spinner().with_message("purging expired claims");
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.enable_steady_tick(Duration::from_millis(100));
    let report = expiry::purge(pool).await;
    spinner.finish_and_clear();
    let report = report.map_err(|error| {
        CliError::new(
            error.to_string(),
            "nothing was lost: every step of the purge can be resumed, and the next run (a router's, or `idem purge` again) goes on from the step this one stopped at; if it keeps failing on a lock, end the session it names (or see pg_stat_activity); `idem status` shows the last error",
        )
    })?;
    let json = json!({
        "skipped": report.skipped,
        "retention_seconds": report.retention.map(|r| r.as_secs_f64()),
        "transition_ended": report.transition_ended,
        "rotated_to": report.rotated_to,
        "expired": report.expired,
        "kept": report.kept,
        "freed_bytes": report.freed_bytes,
        "pieces_dropped": report.pieces_dropped,
        "transition": report.transition.as_ref().map(|t| json!({
            "generation": t.generation,
            "seconds": t.waited.as_secs_f64(),
            "waiting_for": t.blockers.iter().map(ToString::to_string).collect::<Vec<_>>(),
        })),
    });
    let text = if report.skipped {
        "another purge is running (it holds the purge lock): this one did nothing".to_owned()
    } else {
        let mut lines = vec![format!(
            "retention applied       {}",
            retention(report.retention)
        )];
        if report.retention.is_none() {
            lines.push("no handler lets its claims expire: nothing rotates or expires".to_owned());
        }
        lines.push(format!(
            "transition ended        {}",
            report
                .transition_ended
                .map_or("no".to_owned(), |g| format!("generation {g} is current"))
        ));
        lines.push(format!(
            "rotated to              {}",
            report
                .rotated_to
                .map_or("no rotation due".to_owned(), |g| format!("generation {g}"))
        ));
        lines.push(format!(
            "generations dropped     {}",
            if report.expired.is_empty() {
                "none".to_owned()
            } else {
                report
                    .expired
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
        lines.push(format!("claims kept forever     {}", report.kept));
        lines.push(format!("bytes freed             {}", report.freed_bytes));
        if report.pieces_dropped > 0 {
            lines.push(format!(
                "pieces dropped          {} (one at a time)",
                report.pieces_dropped
            ));
        }
        if let Some(transition) = &report.transition {
            lines.extend(crate::status::transition_lines(transition));
        }
        lines.join("\n")
    };
    Ok(Report::done(json, text))
}

/// `idem migrate`.
pub async fn migrate(pool: &PgPool) -> Result<Report, CliError> {
    schema::migrate(pool).await.map_err(|error| {
        CliError::new(
            format!("the migration failed: {error}"),
            "each migration runs in its own transaction, so the schema is at the last one that committed; fix the cause (permissions? a conflicting table?) and run `idem migrate` again",
        )
    })?;
    let version = schema::latest_version();
    Ok(Report::done(
        json!({ "version": version }),
        format!("the dedup schema is at version {version}, the latest this idem ships"),
    ))
}

/// `idem verify`.
pub async fn verify(pool: &PgPool) -> Result<Report, CliError> {
    verify_schema(pool).await?;
    let version = schema::latest_version();
    Ok(Report::done(
        json!({ "ok": true, "version": version }),
        format!("the dedup schema is applied and current (version {version})"),
    ))
}

/// Fails, saying to migrate, unless the schema is applied and current.
pub async fn verify_schema(pool: &PgPool) -> Result<(), CliError> {
    match schema::verify(pool).await {
        Ok(()) => Ok(()),
        Err(idem_runtime::Error::SchemaMissing { expected, found }) => Err(CliError::new(
            match found {
                Some(found) => format!(
                    "the dedup schema in this database is at version {found}; this idem needs version {expected}"
                ),
                None => format!(
                    "this database has no idem dedup schema (this idem needs version {expected})"
                ),
            },
            "run `idem migrate` (or start a service, which migrates at start-up), and check that DATABASE_URL names the services' database",
        )),
        Err(error) => Err(CliError::new(
            format!("cannot read the dedup schema's version: {error}"),
            "check that DATABASE_URL names the services' database and that its user may read it",
        )),
    }
}
