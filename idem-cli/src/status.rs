//! `idem status` and `idem dedup check`.

use async_nats::jetstream;
use idem_runtime::{outbox, status};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::output::{self, CliError, Report, human, or_dash, retention, rfc3339_exact};

/// `idem status`: the consumers (from NATS), the handlers' claims and the
/// outbox (from the database).
pub async fn status(js: &jetstream::Context, pool: &PgPool) -> Result<Report, CliError> {
    let consumers = status::consumers(js).await.map_err(|error| {
        CliError::new(
            error.to_string(),
            "check that NATS_URL names the services' NATS server",
        )
    })?;
    let handlers = status::handlers(pool).await.map_err(database_error)?;
    let lag = outbox::lag(pool).await.map_err(database_error)?;
    let durability = status::durability(pool).await.map_err(database_error)?;

    let handler = |name: Option<&str>| {
        name.and_then(|name| handlers.iter().find(|handler| handler.name == name))
    };
    let consumers_json: Vec<Value> = consumers
        .iter()
        .map(|consumer| {
            let claims = handler(consumer.handler.as_deref());
            json!({
                "stream": consumer.stream,
                "durable": consumer.durable,
                "handler": consumer.handler,
                "pending": consumer.pending,
                "ack_pending": consumer.ack_pending,
                "redelivered": consumer.redelivered,
                "waiting": consumer.waiting,
                "retention_seconds": consumer.retention.map(|r| r.as_secs_f64()),
                "dead_letter_subject": consumer.dead_letter_subject,
                "dead_letters": consumer.dead_letters,
                "claims": claims.map(|h| h.claims),
                "oldest_claim_age_seconds": claims.and_then(|h| h.oldest_age).map(|a| a.as_secs_f64()),
            })
        })
        .collect();
    let handlers_json: Vec<Value> = handlers
        .iter()
        .map(|handler| {
            json!({
                "name": handler.name,
                "retention_seconds": handler.retention.map(|r| r.as_secs_f64()),
                "claims": handler.claims,
                "oldest_claim": handler.oldest_claim.map(rfc3339_exact),
                "oldest_claim_age_seconds": handler.oldest_age.map(|a| a.as_secs_f64()),
            })
        })
        .collect();
    let json = json!({
        "consumers": consumers_json,
        "handlers": handlers_json,
        "outbox": {
            "pending": lag.pending,
            "oldest_age_seconds": lag.oldest.as_secs_f64(),
        },
        "database_durability": {
            "synchronous_commit": durability.synchronous_commit,
            "idem_commits_with": durability.idem_commits_with,
            "synchronous_standby_names": durability.synchronous_standby_names,
            "standbys": durability.standbys.iter().map(|(name, state)| json!({
                "name": name,
                "sync_state": state,
            })).collect::<Vec<_>>(),
            "warnings": durability.warnings,
        },
    });

    let mut text = String::new();
    if consumers.is_empty() {
        text.push_str("no idem consumers on this NATS server (a route creates its consumer when its router starts)\n");
    } else {
        let mut table = output::table([
            "CONSUMER",
            "HANDLER",
            "PENDING",
            "ACK PENDING",
            "REDELIVERED",
            "DEAD LETTERS",
            "CLAIMS",
            "OLDEST CLAIM",
        ]);
        for consumer in &consumers {
            let claims = handler(consumer.handler.as_deref());
            table.add_row([
                format!("{}/{}", consumer.stream, consumer.durable),
                or_dash(consumer.handler.as_deref()),
                consumer.pending.to_string(),
                consumer.ack_pending.to_string(),
                consumer.redelivered.to_string(),
                or_dash(consumer.dead_letters),
                or_dash(claims.map(|h| h.claims)),
                or_dash(claims.and_then(|h| h.oldest_age).map(human)),
            ]);
        }
        text.push_str(&output::render(&table));
        text.push_str("\n\n");
    }
    if handlers.is_empty() {
        text.push_str("no handlers registered in the dedup schema yet\n");
    } else {
        let mut table = output::table(["HANDLER", "RETENTION", "CLAIMS", "OLDEST CLAIM"]);
        for handler in &handlers {
            table.add_row([
                handler.name.clone(),
                retention(handler.retention),
                handler.claims.to_string(),
                or_dash(handler.oldest_age.map(human)),
            ]);
        }
        text.push_str(&output::render(&table));
        text.push_str("\n\n");
    }
    text.push_str(&format!(
        "outbox: {} pending{}",
        lag.pending,
        if lag.pending > 0 {
            format!(", the oldest {} old", human(lag.oldest))
        } else {
            String::new()
        }
    ));
    text.push_str(&format!(
        "\ndatabase durability: synchronous_commit {} (idem commits with {}), {}",
        durability.synchronous_commit,
        durability.idem_commits_with,
        if durability.standbys.is_empty() {
            "no standby".to_owned()
        } else {
            let standbys: Vec<String> = durability
                .standbys
                .iter()
                .map(|(name, state)| {
                    format!(
                        "{name} {}",
                        state.as_deref().unwrap_or("(state unreadable)")
                    )
                })
                .collect();
            format!("standbys: {}", standbys.join(", "))
        }
    ));
    for warning in &durability.warnings {
        text.push_str(&format!("\n  warning: {warning}"));
    }
    Ok(Report::done(json, text))
}

/// `idem dedup check <handler> <message-id>`.
pub async fn check(pool: &PgPool, handler: &str, message_id: &str) -> Result<Report, CliError> {
    let names = status::handler_names(pool).await.map_err(database_error)?;
    if !names.iter().any(|name| name == handler) {
        return Err(CliError::new(
            format!("no handler named `{handler}` has ever run against this database"),
            if names.is_empty() {
                "no handler is registered yet: check that DATABASE_URL names the services' database"
                    .to_owned()
            } else {
                format!("the handlers are: {}", names.join(", "))
            },
        ));
    }
    let claim = status::processed(pool, handler, message_id)
        .await
        .map_err(database_error)?;
    let json = json!({
        "handler": handler,
        "message_id": message_id,
        "processed": claim.is_some(),
        "claimed_at": claim.as_ref().map(|c| rfc3339_exact(c.claimed_at)),
        "age_seconds": claim.as_ref().map(|c| c.age.as_secs_f64()),
        "generation": claim.as_ref().map(|c| c.generation),
        "has_result": claim.as_ref().map(|c| c.has_result),
    });
    let text = match &claim {
        Some(claim) => format!(
            "processed: `{handler}` claimed `{message_id}` at {} ({} ago){}; a copy of it now is skipped",
            output::rfc3339(claim.claimed_at),
            human(claim.age),
            if claim.has_result {
                ", with a stored result"
            } else {
                ""
            }
        ),
        None => format!(
            "not processed: `{handler}` holds no claim on `{message_id}` (never processed, still in progress, or its claim has expired); a copy of it now is processed"
        ),
    };
    Ok(Report::done(json, text))
}

fn database_error(error: sqlx::Error) -> CliError {
    CliError::new(
        format!("reading the dedup tables failed: {error}"),
        "check that the database is up; `idem verify` checks the schema",
    )
}
