//! `idem outbox retry`: failing outbox rows retried now, once the cause of
//! their failures is fixed, rather than after their back-off (up to the
//! relay's `max_row_backoff`, 60 s by default). The same on every database:
//! the outbox's table and its relay's back-off are alike on PostgreSQL,
//! SQLite and MariaDB.

use idem_runtime::outbox;
use serde_json::json;

use crate::connect::{Database, with_pool};
use crate::output::{CliError, Report};

/// `idem outbox retry [--subject SUBJECT]`.
pub async fn retry(database: &Database, subject: Option<&str>) -> Result<Report, CliError> {
    let rows = with_pool!(database, pool => outbox::retry_failing(pool, subject).await).map_err(
        |error| {
            CliError::new(
                format!("making the failing outbox rows due failed: {error}"),
                "nothing was changed; check that the database is up and that its user may update idem_outbox",
            )
        },
    )?;
    let which = subject.map_or_else(String::new, |subject| format!(" of `{subject}`"));
    let text = if rows == 0 {
        format!("no failing outbox rows{which}: nothing to retry")
    } else {
        format!(
            "{rows} failing outbox rows{which} are due now: a running relay retries them within about a second (`idem status` shows any that fail again, with why)"
        )
    };
    Ok(Report::done(
        json!({ "retried": rows, "subject": subject }),
        text,
    ))
}
