//! `idem purge`, `idem migrate`, `idem verify`: the dedup schema and its
//! retention, on PostgreSQL or SQLite.

use std::time::Duration;

use idem_runtime::retention::expiry::{self, PurgeReport};
use idem_runtime::schema;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::connect::{Database, with_pool};
use crate::output::{CliError, Report, retention};

/// `idem purge`: one run of the retention purge, with a spinner while it
/// runs (on PostgreSQL a `DETACH ... CONCURRENTLY` waits for transactions
/// that may use the generation; on SQLite each chunk of deletions waits for
/// the write lock).
pub async fn purge(database: &Database) -> Result<Report, CliError> {
    let spinner = ProgressBar::new_spinner().with_message("purging expired claims");
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.enable_steady_tick(Duration::from_millis(100));
    let report = with_pool!(database, pool => expiry::purge(pool).await);
    spinner.finish_and_clear();
    let report = report.map_err(|error| {
        CliError::new(
            error.to_string(),
            match database {
                Database::Postgres(_) => "nothing was lost: every step of the purge can be resumed, and the next run (a router's, or `idem purge` again) goes on from the step this one stopped at; if it keeps failing on a lock, end the session it names (or see pg_stat_activity); `idem status` shows the last error",
                Database::Sqlite(_) => "nothing was lost: each chunk of deletions commits by itself, and the next run (a router's, or `idem purge` again) deletes the rest; if the database is locked, a transaction elsewhere holds SQLite's write lock (`idem status` says whether it is free)",
                Database::Mariadb(_) => "nothing was lost: each chunk of deletions commits by itself, and the next run (a router's, or `idem purge` again) deletes the rest; a lock waited for past 30 s means a transaction elsewhere holds idem_claims' rows (see information_schema.innodb_trx)",
            },
        )
    })?;
    Ok(match database {
        Database::Postgres(_) => postgres_purge_report(&report),
        Database::Sqlite(_) | Database::Mariadb(_) => sqlite_purge_report(&report),
    })
}

/// What a purge on PostgreSQL did: generations ended, rotated, dropped.
fn postgres_purge_report(report: &PurgeReport) -> Report {
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
    Report::done(json, text)
}

/// What a purge on SQLite did: it has no generations, and deletes each
/// handler's claims older than its retention.
fn sqlite_purge_report(report: &PurgeReport) -> Report {
    let json = json!({
        "skipped": report.skipped,
        "retention_seconds": report.retention.map(|r| r.as_secs_f64()),
        "deleted": report.deleted,
    });
    let mut lines = vec![format!(
        "claims deleted          {} (each handler's older than its own retention)",
        report.deleted
    )];
    lines.push(format!(
        "longest retention       {}",
        retention(report.retention)
    ));
    if report.retention.is_none() {
        lines.push("no handler lets its claims expire: nothing expires".to_owned());
    }
    Report::done(json, lines.join("\n"))
}

/// `idem migrate`. On SQLite it creates the database file only when the
/// URL asks for it (`?mode=rwc`, see `connect.rs`).
pub async fn migrate(database: &Database) -> Result<Report, CliError> {
    with_pool!(database, pool => schema::migrate(pool).await).map_err(|error| {
        CliError::new(
            format!("the migration failed: {error}"),
            match database {
                Database::Mariadb(_) => "MariaDB commits each DDL statement by itself, so a failed migration stays recorded as failed (`success = 0` in _idem_migrations) and every later run stops on it; fix the cause (permissions?), delete that row, and run `idem migrate` again (idem's statements are CREATE TABLE IF NOT EXISTS, safe to run twice)",
                _ => "each migration runs in its own transaction, so the schema is at the last one that committed; fix the cause (permissions? a conflicting table?) and run `idem migrate` again",
            },
        )
    })?;
    let version = applied_version(database).await?;
    Ok(Report::done(
        json!({ "version": version }),
        match database {
            Database::Postgres(_) => {
                format!("the dedup schema is at version {version}, the latest this idem ships")
            }
            Database::Sqlite(_) => format!(
                "the dedup schema is at version {version} of SQLite's migrations, the latest this idem ships"
            ),
            Database::Mariadb(_) => format!(
                "the dedup schema is at version {version} of MariaDB's migrations, the latest this idem ships"
            ),
        },
    ))
}

/// `idem verify`.
pub async fn verify(database: &Database) -> Result<Report, CliError> {
    verify_schema(database).await?;
    let version = applied_version(database).await?;
    Ok(Report::done(
        json!({ "ok": true, "version": version }),
        format!("the dedup schema is applied and current (version {version})"),
    ))
}

/// The schema's version once it is current: on PostgreSQL the newest this
/// idem ships; on SQLite, whose migrations are numbered apart, the newest
/// its history table records.
async fn applied_version(database: &Database) -> Result<i64, CliError> {
    let recorded = match database {
        Database::Postgres(_) => return Ok(schema::latest_version()),
        Database::Sqlite(pool) => idem_runtime::status::sqlite::schema_version(pool).await,
        Database::Mariadb(pool) => idem_runtime::status::mariadb::schema_version(pool).await,
    };
    recorded
            .map_err(|error| {
                CliError::new(
                    format!("cannot read the dedup schema's version: {error}"),
                    "check that DATABASE_URL names the services' database and that this user may read it",
                )
            })?
            .ok_or_else(|| {
                CliError::plain("the dedup schema records no migration, though it verified")
            })
}

/// Fails, saying to migrate, unless the schema is applied and current.
pub async fn verify_schema(database: &Database) -> Result<(), CliError> {
    match with_pool!(database, pool => schema::verify(pool).await) {
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
