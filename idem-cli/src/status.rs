//! `idem status` and `idem dedup check`, on PostgreSQL, SQLite or MariaDB.
//!
//! Consumers (from NATS), the handlers' claims and the outbox read the
//! same on all three (only PostgreSQL has the outbox's NOTIFY trigger).
//! The rest is each database's own: on PostgreSQL the generations' expiry
//! and `synchronous_commit`; on SQLite the claims past their retention,
//! `journal_mode` and `synchronous`, and whether the write lock that every
//! claim takes can be taken; on MariaDB the claims past their retention
//! and the server's durability settings.

use async_nats::jetstream;
use idem_runtime::outbox::{self, Lag};
use idem_runtime::retention::expiry::Transition;
use idem_runtime::status;
use idem_runtime::status::sqlite::WriteLock;
use idem_runtime::status::{ExpiryStatus, HandlerStatus};
use serde_json::{Value, json};
use sqlx::{PgPool, SqlitePool};

use crate::connect::{CONNECT_TIMEOUT, Database, with_pool};
use crate::output::{self, CliError, Report, human, or_dash, retention, rfc3339_exact};

/// `idem status`: the consumers (from NATS), the handlers' claims, and
/// what the database says of expiry, the outbox and durability.
pub async fn status(js: &jetstream::Context, database: &Database) -> Result<Report, CliError> {
    let consumers = status::consumers(js).await.map_err(|error| {
        CliError::new(
            error.to_string(),
            "check that NATS_URL names the services' NATS server",
        )
    })?;
    let handlers =
        with_pool!(database, pool => status::handlers(pool).await).map_err(database_error)?;
    let claims = Claims {
        consumers: &consumers,
        handlers: &handlers,
    };
    match database {
        Database::Postgres(pool) => postgres_status(pool, &claims).await,
        Database::Sqlite(pool) => sqlite_status(pool, &claims).await,
        Database::Mariadb(pool) => mariadb_status(pool, &claims).await,
    }
}

/// What `idem status` shows the same on every database.
struct Claims<'a> {
    consumers: &'a [status::ConsumerStatus],
    handlers: &'a [HandlerStatus],
}

impl Claims<'_> {
    fn handler(&self, name: Option<&str>) -> Option<&HandlerStatus> {
        name.and_then(|name| self.handlers.iter().find(|handler| handler.name == name))
    }

    fn consumers_json(&self) -> Vec<Value> {
        self.consumers
            .iter()
            .map(|consumer| {
                let claims = self.handler(consumer.handler.as_deref());
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
                    "pull_batch": consumer.pull_batch,
                    "max_batch": consumer.max_batch,
                    "pull_capped": consumer.pull_capped(),
                    "paused_seconds": consumer.paused_for.map(|left| left.as_secs_f64()),
                    "claims": claims.map(|h| h.claims),
                    "oldest_claim_age_seconds": claims.and_then(|h| h.oldest_age).map(|a| a.as_secs_f64()),
                })
            })
            .collect()
    }

    fn handlers_json(&self) -> Vec<Value> {
        self.handlers
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
            .collect()
    }

    /// The consumers' table and its warnings, then the handlers' table.
    fn text(&self) -> String {
        let mut text = String::new();
        if self.consumers.is_empty() {
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
            for consumer in self.consumers {
                let claims = self.handler(consumer.handler.as_deref());
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
            text.push('\n');
            for line in pull_lines(self.consumers)
                .into_iter()
                .chain(pause_lines(self.consumers))
            {
                text.push_str(&line);
                text.push('\n');
            }
            text.push('\n');
        }
        if self.handlers.is_empty() {
            text.push_str("no handlers registered in the dedup schema yet\n");
        } else {
            let mut table = output::table(["HANDLER", "RETENTION", "CLAIMS", "OLDEST CLAIM"]);
            for handler in self.handlers {
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
        text
    }
}

/// `idem status` on PostgreSQL: expiry by generations, the outbox with the
/// rows that keep failing and why, and `synchronous_commit`.
async fn postgres_status(pool: &PgPool, claims: &Claims<'_>) -> Result<Report, CliError> {
    // A read, bounded: a session that holds a lock on the outbox's table
    // (which stops the relays too) must not make `idem status` hang.
    let lag = tokio::time::timeout(OUTBOX_READ_BOUND, outbox::lag(pool))
        .await
        .map_err(|_| outbox_locked())?;
    let outbox = OutboxStatus {
        lag: lag.map_err(database_error)?,
        wakeups: Wakeups::Notify(status::outbox_notify(pool).await.map_err(database_error)?),
    };
    let expiry = status::expiry(pool).await.map_err(database_error)?;
    let durability = status::durability(pool).await.map_err(database_error)?;

    let json = json!({
        "consumers": claims.consumers_json(),
        "handlers": claims.handlers_json(),
        "outbox": outbox.json(),
        "expiry": expiry_json(&expiry),
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

    let mut text = claims.text();
    for line in expiry_lines(&expiry) {
        text.push_str(&line);
        text.push('\n');
    }
    text.push_str(&outbox.text());
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

/// The outbox as `idem status` shows it, on any database: how far its
/// relays are behind, the rows that keep failing and why, and how relays
/// learn of new rows.
struct OutboxStatus {
    lag: Lag,
    wakeups: Wakeups,
}

/// How a relay learns that rows were queued.
enum Wakeups {
    /// PostgreSQL's: whether the outbox's NOTIFY trigger is enabled, so
    /// that relays in other processes hear of each queuing COMMIT.
    Notify(bool),
    /// A database without notifications (SQLite, MariaDB, named here):
    /// relays are woken by their own process's commits, and poll.
    Polled(&'static str),
}

impl OutboxStatus {
    /// The same shape on every database; `notify_trigger` is null where
    /// the database has no notifications.
    fn json(&self) -> Value {
        let lag = &self.lag;
        json!({
            "pending": lag.pending,
            "oldest_age_seconds": lag.oldest.as_secs_f64(),
            "failing": lag.failing,
            "notify_trigger": match self.wakeups {
                Wakeups::Notify(enabled) => Some(enabled),
                Wakeups::Polled(_) => None,
            },
            "failures": lag.failures.iter().map(|failing| json!({
                "subject": failing.subject,
                "error": failing.error,
                "rows": failing.rows,
                "attempts": failing.attempts,
                "oldest_age_seconds": failing.oldest.as_secs_f64(),
                "next_attempt_seconds": failing.next_attempt.as_secs_f64(),
            })).collect::<Vec<_>>(),
            "blocked": lag.blocked.iter().map(|wait| json!({
                "waited_seconds": wait.waited.as_secs_f64(),
                "holder_pid": wait.holder_pid,
                "holder_state": wait.holder_state,
                "holder_transaction_seconds": wait.holder_transaction.map(|age| age.as_secs_f64()),
                "holder_query": wait.holder_query,
            })).collect::<Vec<_>>(),
        })
    }

    /// `outbox: ...`, and a table of the failing rows if any; no newline
    /// at the end.
    fn text(&self) -> String {
        let lag = &self.lag;
        let mut text = format!(
            "outbox: {} pending{}",
            lag.pending,
            if lag.pending > 0 {
                format!(", the oldest {} old", human(lag.oldest))
            } else {
                String::new()
            }
        );
        match self.wakeups {
            Wakeups::Notify(true) => text.push_str(
                "; NOTIFY trigger on: each queuing COMMIT notifies the relays (and takes PostgreSQL's server-wide notification lock, so such commits run one at a time)",
            ),
            Wakeups::Notify(false) => text.push_str(
                "; NOTIFY trigger off: relays are woken by their own process's commits, and poll",
            ),
            Wakeups::Polled(database) => text.push_str(&format!(
                "; relays are woken by their own process's commits, and poll ({database} has no notifications)"
            )),
        }
        if lag.failing > 0 {
            text.push_str(&format!(
                "; {} failing: their publishes fail while NATS answers, so each is retried after its own back-off while the rows after them go out. Fix the cause, then `idem outbox retry`.\n\n",
                lag.failing
            ));
            let mut table =
                output::table(["SUBJECT", "ROWS", "ATTEMPTS", "NEXT TRY", "OLDEST", "ERROR"]);
            for failing in &lag.failures {
                table.add_row([
                    failing.subject.clone(),
                    failing.rows.to_string(),
                    failing.attempts.to_string(),
                    if failing.next_attempt.is_zero() {
                        "due".to_owned()
                    } else {
                        format!("in {}", human(failing.next_attempt))
                    },
                    human(failing.oldest),
                    failing.error.clone(),
                ]);
            }
            text.push_str(&output::render(&table));
            let listed: i64 = lag.failures.iter().map(|failing| failing.rows).sum();
            if listed < lag.failing {
                text.push_str(&format!(
                    "\n(and {} more rows of other subjects or errors)",
                    lag.failing - listed
                ));
            }
        }
        if !lag.blocked.is_empty() {
            text.push_str(
                "\nrelays are stopped: their statements wait for a lock on idem_outbox that another session holds. End that transaction, or the session (pg_terminate_backend(pid)):",
            );
            for wait in &lag.blocked {
                text.push_str(&format!("\n  - a relay statement {wait}"));
            }
        }
        text
    }
}

/// Expiry on a database that deletes the claims past their handler's
/// retention (SQLite, MariaDB: no generations), as JSON and as text: the
/// longest retention, and the handlers whose oldest claim is overdue.
fn expiry_by_deletes(claims: &Claims<'_>, database: &str) -> (Value, String) {
    let longest = claims
        .handlers
        .iter()
        .filter_map(|handler| handler.retention)
        .max();
    let overdue = status::overdue(claims.handlers);
    let json = json!({
        "retention_seconds": longest.map(|r| r.as_secs_f64()),
        "behind": !overdue.is_empty(),
        "overdue": overdue.iter().map(|late| json!({
            "handler": late.handler,
            "retention_seconds": late.retention.as_secs_f64(),
            "oldest_claim_age_seconds": late.oldest_age.as_secs_f64(),
            "overdue_seconds": late.overdue.as_secs_f64(),
        })).collect::<Vec<_>>(),
    });
    let mut text = String::new();
    if longest.is_none() {
        text.push_str("expiry: no handler lets its claims expire\n");
    } else if overdue.is_empty() {
        text.push_str(&format!(
            "expiry: each purge deletes the claims past their handler's retention ({database} has no generations), on time; the longest retention {}\n",
            retention(longest)
        ));
    }
    for late in &overdue {
        text.push_str(&format!(
            "expiry behind: `{}`'s oldest claim is {} old, {} past its retention {}: is a router with a retention, or a cron job of `idem purge`, running?\n",
            late.handler,
            human(late.oldest_age),
            human(late.overdue),
            retention(Some(late.retention)),
        ));
    }
    (json, text)
}

/// `idem status` on MariaDB: the claims, expiry by deletes (as on SQLite),
/// the outbox (as on PostgreSQL, without notifications), and the server's
/// durability settings.
async fn mariadb_status(pool: &sqlx::MySqlPool, claims: &Claims<'_>) -> Result<Report, CliError> {
    let outbox = OutboxStatus {
        lag: outbox::lag(pool).await.map_err(database_error)?,
        wakeups: Wakeups::Polled("MariaDB"),
    };
    let durability = status::mariadb::durability(pool)
        .await
        .map_err(database_error)?;
    let (expiry_json, expiry_text) = expiry_by_deletes(claims, "MariaDB");
    let json = json!({
        "consumers": claims.consumers_json(),
        "handlers": claims.handlers_json(),
        "outbox": outbox.json(),
        "expiry": expiry_json,
        "database_durability": {
            "version": durability.version,
            "innodb_flush_log_at_trx_commit": durability.flush_log_at_trx_commit,
            "log_bin": durability.log_bin,
            "sync_binlog": durability.sync_binlog,
            "warnings": durability.warnings,
        },
    });
    let mut text = claims.text();
    text.push_str(&expiry_text);
    text.push_str(&outbox.text());
    text.push_str(&format!(
        "\ndatabase durability: {}, innodb_flush_log_at_trx_commit {}, binary log {}",
        durability.version,
        durability.flush_log_at_trx_commit,
        if durability.log_bin {
            format!("on, sync_binlog {}", durability.sync_binlog)
        } else {
            "off".to_owned()
        }
    ));
    for warning in &durability.warnings {
        text.push_str(&format!("\n  warning: {warning}"));
    }
    Ok(Report::done(json, text))
}

/// `idem status` on SQLite: the handlers whose claims outlived their
/// retention; the outbox (as on PostgreSQL, without notifications);
/// `journal_mode` and `synchronous`; and whether SQLite's write lock can be
/// taken, since while another connection holds it no router on the file
/// makes progress.
async fn sqlite_status(pool: &SqlitePool, claims: &Claims<'_>) -> Result<Report, CliError> {
    let outbox = OutboxStatus {
        lag: outbox::lag(pool).await.map_err(database_error)?,
        wakeups: Wakeups::Polled("SQLite"),
    };
    let durability = status::sqlite::durability(pool)
        .await
        .map_err(database_error)?;
    let write_lock = status::sqlite::write_lock(pool, CONNECT_TIMEOUT)
        .await
        .map_err(database_error)?;
    let (expiry_json, expiry_text) = expiry_by_deletes(claims, "SQLite");

    let json = json!({
        "consumers": claims.consumers_json(),
        "handlers": claims.handlers_json(),
        "outbox": outbox.json(),
        "expiry": expiry_json,
        "database_durability": {
            "journal_mode": durability.journal_mode,
            "command_synchronous": durability.synchronous,
            "filesystem": durability.filesystem,
            "routers": durability.routers.iter().map(|router| json!({
                "handler": router.handler,
                "journal_mode": router.journal_mode,
                "synchronous": router.synchronous,
            })).collect::<Vec<_>>(),
            "warnings": durability.warnings,
        },
        "write_lock": match &write_lock {
            WriteLock::Free => json!({ "state": "free" }),
            WriteLock::Held { waited } => {
                json!({ "state": "held", "waited_seconds": waited.as_secs_f64() })
            }
            WriteLock::Busy { waited } => {
                json!({ "state": "busy", "waited_seconds": waited.as_secs_f64() })
            }
            WriteLock::NotChecked(reason) => json!({ "state": "not-checked", "reason": reason }),
            _ => json!({ "state": "unknown" }),
        },
    });

    let mut text = claims.text();
    text.push_str(&expiry_text);
    text.push_str(&outbox.text());
    text.push_str(&format!(
        "\ndatabase durability: journal_mode {}, synchronous {} (this command's connections: each connection sets its own, and a service's start-up warns when its own is below FULL), on a {} filesystem",
        durability.journal_mode, durability.synchronous, durability.filesystem,
    ));
    for router in &durability.routers {
        text.push_str(&format!(
            "\n  the router that registered `{}` last: journal_mode {}, synchronous {}",
            router.handler, router.journal_mode, router.synchronous
        ));
    }
    for warning in &durability.warnings {
        text.push_str(&format!("\n  warning: {warning}"));
    }
    text.push_str(&match &write_lock {
        WriteLock::Free => "\nwrite lock: free (taken and given back at once)".to_owned(),
        WriteLock::Held { waited } => format!(
            "\nwrite lock: held by another connection for the {} this command waited\n  warning: every message's transaction takes SQLite's write lock at BEGIN, so while it is held no router on this file makes progress and messages are held; a transaction left open elsewhere (another process, an sqlite3 shell) or a handler that runs this long holds it (SQLite does not say which)",
            human(*waited)
        ),
        WriteLock::Busy { waited } => format!(
            "\nwrite lock: busy: other connections committed during the {} this command waited for a turn, so work goes on",
            human(*waited)
        ),
        WriteLock::NotChecked(reason) => {
            format!("\nwrite lock: not checked: this command cannot write to the file (mode=ro in the URL, or the file is read-only to this user): {reason}")
        }
        _ => "\nwrite lock: unknown".to_owned(),
    });
    Ok(Report::done(json, text))
}
/// A line for each consumer an operator paused: its route gets nothing
/// until the pause ends.
fn pause_lines(consumers: &[status::ConsumerStatus]) -> Vec<String> {
    consumers
        .iter()
        .filter_map(|consumer| {
            let left = consumer.paused_for?;
            Some(format!(
                "  warning: {}/{}: paused for another {} (nats consumer pause): JetStream \
                 delivers its route nothing until then; `nats consumer resume` ends it",
                consumer.stream,
                consumer.durable,
                human(left),
            ))
        })
        .collect()
}

/// A line for each consumer whose `max_batch` caps its route's pull
/// requests.
fn pull_lines(consumers: &[status::ConsumerStatus]) -> Vec<String> {
    consumers
        .iter()
        .filter(|consumer| consumer.pull_capped())
        .map(|consumer| {
            format!(
                "  warning: {}/{}: pull requests capped at {} messages by the consumer's max_batch \
                 (its route asks for {}: concurrency x batch), so fewer messages are fetched ahead; \
                 raise the limit (the server's jetstream max_request_batch), or lower the route's \
                 concurrency or its largest batch (`Route::batch`, `Route::adaptive_batch`; a route \
                 left at its defaults takes up to {} messages a batch, {} with a batch handler, \
                 within max_ack_pending / concurrency)",
                consumer.stream,
                consumer.durable,
                or_dash(consumer.max_batch),
                or_dash(consumer.pull_batch),
                idem_runtime::route::DEFAULT_ADAPTIVE_MAX,
                idem_runtime::route::DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER,
            )
        })
        .collect()
}

/// The expiry's figures, for `--json`.
fn expiry_json(expiry: &ExpiryStatus) -> Value {
    json!({
        "retention_seconds": expiry.retention.map(|r| r.as_secs_f64()),
        "current_generation": expiry.current_generation,
        "generations": expiry.generations,
        "due": expiry.due,
        "oldest_due_sealed_seconds": expiry.oldest_due_sealed.map(|a| a.as_secs_f64()),
        "overdue_seconds": expiry.overdue.as_secs_f64(),
        "behind": expiry.behind(),
        "transition": expiry.transition.as_ref().map(|t| json!({
            "generation": t.generation,
            "seconds": t.waited.as_secs_f64(),
            "waiting_for": t.blockers.iter().map(|b| json!({
                "pid": b.pid,
                "prepared": b.prepared,
                "database": b.database,
                "application_name": b.application_name,
                "state": b.state,
                "transaction_age_seconds": b.transaction_age.map(|a| a.as_secs_f64()),
                "query_age_seconds": b.query_age.map(|a| a.as_secs_f64()),
                "query": b.query,
                "reason": b.to_string(),
            })).collect::<Vec<_>>(),
        })),
        "last_success_age_seconds": expiry.last_success_age.map(|a| a.as_secs_f64()),
        "failures": expiry.failures,
        "last_error": expiry.last_error,
        "last_failure_age_seconds": expiry.last_failure_age.map(|a| a.as_secs_f64()),
        "rotation_overdue_seconds": expiry.rotation_overdue().as_secs_f64(),
    })
}

/// The expiry's lines of `idem status`: on time or behind, the purge's last
/// error while runs fail, and a transition with what it waits for.
fn expiry_lines(expiry: &ExpiryStatus) -> Vec<String> {
    let mut lines = Vec::new();
    let failing = match (&expiry.last_error, expiry.last_failure_age) {
        (Some(error), Some(age)) if expiry.failures > 0 => Some(format!(
            "last error ({} failed run{} in a row, the last {} ago): {error}",
            expiry.failures,
            if expiry.failures == 1 { "" } else { "s" },
            human(age)
        )),
        _ => None,
    };
    let last_run = expiry.last_success_age.map_or_else(
        || "no purge run has succeeded yet".to_owned(),
        |age| format!("last purge {} ago", human(age)),
    );
    if expiry.retention.is_none() {
        lines.push("expiry: no handler lets its claims expire".to_owned());
    } else if expiry.behind() {
        let mut line = if expiry.due > 0 {
            format!(
                "expiry behind: {} generation{} due, the oldest sealed {} ago, retention {}",
                expiry.due,
                if expiry.due == 1 { "" } else { "s" },
                or_dash(expiry.oldest_due_sealed.map(human)),
                retention(expiry.retention)
            )
        } else {
            format!(
                "expiry behind: generation {} is {} past its rotation, so nothing comes due, retention {}",
                expiry.current_generation,
                human(expiry.rotation_overdue()),
                retention(expiry.retention)
            )
        };
        match &failing {
            Some(failing) => line.push_str(&format!("; {failing}")),
            None => line.push_str(&format!(
                "; {last_run}, and no run has failed since: is a router with a retention, or a cron job of `idem purge`, running?"
            )),
        }
        lines.push(line);
    } else {
        let mut line = format!(
            "expiry: retention {}, {} generation{} (current {}), on time; {last_run}",
            retention(expiry.retention),
            expiry.generations,
            if expiry.generations == 1 { "" } else { "s" },
            expiry.current_generation
        );
        if let Some(failing) = &failing {
            line.push_str(&format!("; {failing}"));
        }
        lines.push(line);
    }
    if let Some(transition) = &expiry.transition {
        lines.extend(transition_lines(transition));
    }
    lines
}

/// A rotation in transition, and each transaction it waits for.
pub(crate) fn transition_lines(transition: &Transition) -> Vec<String> {
    let waiting = match transition.blockers.len() {
        0 => "it waits for none any more (the next purge run ends it)".to_owned(),
        1 => "the transaction it waits for ends:".to_owned(),
        n => format!("the {n} transactions it waits for end:"),
    };
    let mut lines = vec![format!(
        "rotation to generation {} in transition for {}: claims go into two generations until {waiting}",
        transition.generation,
        human(transition.waited),
    )];
    lines.extend(transition.blockers.iter().map(|b| format!("  {b}")));
    lines
}

/// `idem dedup check <handler> <message-id>`.
pub async fn check(
    database: &Database,
    handler: &str,
    message_id: &str,
) -> Result<Report, CliError> {
    let names =
        with_pool!(database, pool => status::handler_names(pool).await).map_err(database_error)?;
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
    let claim = with_pool!(database, pool => status::processed(pool, handler, message_id).await)
        .map_err(database_error)?;
    // SQLite keeps its claims in one table: no generation to name.
    let generation = claim
        .as_ref()
        .filter(|_| matches!(database, Database::Postgres(_)))
        .map(|c| c.generation);
    let json = json!({
        "handler": handler,
        "message_id": message_id,
        "processed": claim.is_some(),
        "claimed_at": claim.as_ref().map(|c| rfc3339_exact(c.claimed_at)),
        "age_seconds": claim.as_ref().map(|c| c.age.as_secs_f64()),
        "generation": generation,
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

/// How long `idem status` waits to read the outbox on PostgreSQL.
const OUTBOX_READ_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// The outbox could not be read within [`OUTBOX_READ_BOUND`]: its table is
/// locked, and the relays wait as well.
fn outbox_locked() -> CliError {
    CliError::new(
        format!(
            "reading idem_outbox waited over {}s for a lock: another session holds one (a LOCK TABLE, ALTER TABLE or VACUUM FULL of it left open), and every outbox relay waits for it too, publishing nothing",
            OUTBOX_READ_BOUND.as_secs()
        ),
        "find the session with SELECT pid, state, xact_start, query FROM pg_stat_activity WHERE pid IN (SELECT pid FROM pg_locks WHERE relation = 'idem_outbox'::regclass AND granted), then end its transaction, or pg_terminate_backend(pid)",
    )
}

fn database_error(error: sqlx::Error) -> CliError {
    CliError::new(
        format!("reading the dedup tables failed: {error}"),
        "check that the database is up; `idem verify` checks the schema",
    )
}
