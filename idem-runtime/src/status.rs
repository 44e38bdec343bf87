//! What idem's consumers and dedup tables hold now: for operators,
//! dashboards and the `idem` command (`idem status`, `idem dedup check`).
//!
//! A route records on its consumer, besides its retention (see
//! [`dead_letter`](crate::dead_letter)), the handler it runs
//! (`idem.handler`) and its dead-letter subject (`idem.dead_letters`), so
//! that [`consumers`] finds every idem consumer on a server and ties it to
//! its handler and its dead letters without knowing the application's
//! routes. [`durability`] reads how durable PostgreSQL makes the commits
//! idem acks after, [`outbox_notify`] whether queuing commits notify the
//! outbox's relays.
//!
//! ```no_run
//! # async fn f(js: async_nats::jetstream::Context, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! for consumer in idem_runtime::status::consumers(&js).await? {
//!     println!("{}/{}: {} pending, {:?} dead letters", consumer.stream, consumer.durable,
//!         consumer.pending, consumer.dead_letters);
//! }
//! if let Some(claim) = idem_runtime::status::processed(&pool, "ledger.credit.v1", "t-42").await? {
//!     println!("processed {:?} ago", claim.age);
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures_util::TryStreamExt;
use sqlx::{PgPool, Pool};
use time::OffsetDateTime;

use crate::error::retention::decode_duration;
use crate::route::metadata::{DEAD_LETTERS_KEY, HANDLER_KEY, PULL_BATCH_KEY, RETENTION_KEY};

pub use crate::retention::status::{ExpiryStatus, expiry};
use crate::retention::status::{seconds, timestamp};
use crate::store::backend::Backend;

/// One idem consumer as JetStream sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStatus {
    /// Its stream.
    pub stream: String,
    /// Its durable name (the route's).
    pub durable: String,
    /// The handler its route runs; `None` for a consumer set up by an idem
    /// that did not record it.
    pub handler: Option<String>,
    /// Messages not yet delivered.
    pub pending: u64,
    /// Messages delivered and not yet acked (in flight, or waiting for a
    /// redelivery).
    pub ack_pending: u64,
    /// Messages delivered more than once and not yet acked.
    pub redelivered: u64,
    /// Pull requests waiting (about one per running worker).
    pub waiting: u64,
    /// How long its route keeps claims; `None`: forever.
    pub retention: Option<Duration>,
    /// Where its dead letters go.
    pub dead_letter_subject: String,
    /// Dead letters stored under that subject; `None` if no stream stores
    /// it (no router started since it was set), or it could not be read.
    pub dead_letters: Option<u64>,
    /// How many messages each pull request of its route asks for
    /// (concurrency × batch); `None` for a route of an idem that did not
    /// record it.
    pub pull_batch: Option<u64>,
    /// The consumer's `max_batch`: the most one pull request may ask for
    /// (its own, or the server's `max_request_batch` limit); `None`: no
    /// limit.
    pub max_batch: Option<u64>,
    /// How much longer an operator's pause of the consumer lasts (`nats
    /// consumer pause`): JetStream delivers its route nothing meanwhile.
    /// `None`: not paused.
    pub paused_for: Option<Duration>,
}

impl ConsumerStatus {
    /// Whether the consumer's `max_batch` caps its route's pull requests:
    /// each asks for `max_batch` messages instead, so fewer are fetched
    /// ahead (the route also warns, and sets `idem_pull_request_capped`).
    ///
    /// ```
    /// # fn f(consumer: &idem_runtime::status::ConsumerStatus) {
    /// if consumer.pull_capped() {
    ///     println!("{}: pull requests capped at {:?}", consumer.durable, consumer.max_batch);
    /// }
    /// # }
    /// ```
    pub fn pull_capped(&self) -> bool {
        matches!((self.pull_batch, self.max_batch), (Some(wanted), Some(max)) if wanted > max)
    }
}

/// Why [`consumers`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatusError {
    /// Listing the streams failed.
    #[error("listing JetStream streams failed: {0}; check that NATS is reachable")]
    Streams(async_nats::Error),
    /// Listing a stream's consumers failed.
    #[error("listing the consumers of stream `{stream}` failed: {source}")]
    Consumers {
        /// The stream.
        stream: String,
        /// The server's answer.
        source: async_nats::Error,
    },
}

/// Every idem consumer on the server (those whose metadata records a
/// retention, which every route writes), sorted by stream and durable, with
/// its counts and its dead letters.
pub async fn consumers(js: &jetstream::Context) -> Result<Vec<ConsumerStatus>, StatusError> {
    let streams: Vec<String> = js
        .stream_names()
        .try_collect()
        .await
        .map_err(|e| StatusError::Streams(e.into()))?;
    let mut found = Vec::new();
    for stream in streams {
        let consumers_error = |source: async_nats::Error| StatusError::Consumers {
            stream: stream.clone(),
            source,
        };
        let handle = js
            .get_stream_no_info(&stream)
            .await
            .map_err(|e| consumers_error(e.into()))?;
        let infos: Vec<consumer::Info> = handle
            .consumers()
            .try_collect()
            .await
            .map_err(|e| consumers_error(e.into()))?;
        for info in infos {
            let metadata = &info.config.metadata;
            let Some(retention) = metadata.get(RETENTION_KEY) else {
                continue;
            };
            let dead_letter_subject =
                metadata.get(DEAD_LETTERS_KEY).cloned().unwrap_or_else(|| {
                    crate::route::default_dead_letter_subject(&info.stream_name, &info.name)
                });
            found.push(ConsumerStatus {
                stream: info.stream_name.clone(),
                durable: info.name.clone(),
                handler: metadata.get(HANDLER_KEY).cloned(),
                pending: info.num_pending,
                ack_pending: info.num_ack_pending as u64,
                redelivered: info.num_redelivered as u64,
                waiting: info.num_waiting as u64,
                retention: decode_duration(retention),
                pull_batch: metadata.get(PULL_BATCH_KEY).and_then(|n| n.parse().ok()),
                max_batch: u64::try_from(info.config.max_batch).ok().filter(|n| *n > 0),
                paused_for: info
                    .paused
                    .then(|| info.pause_remaining.unwrap_or_default()),
                dead_letters: dead_letter_count(js, &dead_letter_subject).await,
                dead_letter_subject,
            });
        }
    }
    found.sort_by(|a, b| (&a.stream, &a.durable).cmp(&(&b.stream, &b.durable)));
    Ok(found)
}

/// How many messages are stored under `subject`, in whichever stream
/// captures it.
async fn dead_letter_count(js: &jetstream::Context, subject: &str) -> Option<u64> {
    let stream = js.stream_by_subject(subject).await.ok()?;
    let counts = crate::dead_letter::subject_counts(js, &stream, subject)
        .await
        .ok()?;
    Some(counts.values().sum())
}

/// The claims of one handler, as the dedup table holds them now.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HandlerStatus {
    /// The handler's name.
    pub name: String,
    /// How long it keeps claims; `None`: forever.
    pub retention: Option<Duration>,
    /// Its claims (messages processed and not yet expired).
    pub claims: u64,
    /// When its oldest claim was made.
    pub oldest_claim: Option<OffsetDateTime>,
    /// How old that claim is, by the database's clock.
    pub oldest_age: Option<Duration>,
}

/// Every handler registered in the dedup schema, by name, with its claims.
/// Counts every claim (a scan of the claims table), so it takes a while on a
/// table of many millions.
pub async fn handlers<DB: Backend>(pool: &Pool<DB>) -> Result<Vec<HandlerStatus>, sqlx::Error> {
    let rows = DB::handlers(pool).await?;
    Ok(rows
        .into_iter()
        .map(|(name, retention, claims, oldest, age)| HandlerStatus {
            name,
            retention: retention.map(seconds),
            claims: claims as u64,
            oldest_claim: oldest.and_then(timestamp),
            oldest_age: age.map(seconds),
        })
        .collect())
}

/// A committed claim: the message was processed.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Processed {
    /// When it was claimed (the start of the transaction that processed it).
    pub claimed_at: OffsetDateTime,
    /// How long ago, by the database's clock.
    pub age: Duration,
    /// The generation of the claims table it is in (0: kept forever).
    pub generation: i32,
    /// Whether a result is stored with it
    /// ([`results::stored`](crate::handler::results::stored) reads it).
    pub has_result: bool,
}

/// Whether the handler named `handler` processed `message_id`, and when:
/// `None` if it did not (or its claim has expired). It reads committed
/// claims only, so a message being processed now reads as not processed.
pub async fn processed<DB: Backend>(
    pool: &Pool<DB>,
    handler: &str,
    message_id: &str,
) -> Result<Option<Processed>, sqlx::Error> {
    let key = crate::store::claim::key(handler, message_id);
    let row = DB::claim_row(pool, &key).await?;
    Ok(
        row.map(|(claimed_at, age, generation, has_result)| Processed {
            claimed_at: timestamp(claimed_at).unwrap_or(OffsetDateTime::UNIX_EPOCH),
            age: seconds(age),
            generation,
            has_result,
        }),
    )
}

/// The names of the handlers registered in the dedup schema (every handler
/// a router has started), sorted: one cheap query, to tell an unknown name
/// from a message not processed.
pub async fn handler_names<DB: Backend>(pool: &Pool<DB>) -> Result<Vec<String>, sqlx::Error> {
    DB::handler_names(pool).await
}

/// Whether the outbox's NOTIFY trigger (`idem_outbox_notify`) is enabled:
/// migration 7 disables it, and an operator may enable it again with
/// `ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify` (see the
/// guide's outbox chapter). While it is, each queuing COMMIT notifies the
/// relays, which LISTEN, and takes PostgreSQL's server-wide notification
/// lock; while it is not, relays are woken by their own process's commits
/// and poll. `false` where there is no outbox table yet.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// if idem_runtime::status::outbox_notify(&pool).await? {
///     println!("queuing commits notify the relays");
/// }
/// # Ok(())
/// # }
/// ```
pub async fn outbox_notify(pool: &PgPool) -> Result<bool, sqlx::Error> {
    crate::outbox::notify_trigger_enabled(pool).await
}

/// How durable PostgreSQL makes the commits idem acks after, as the pool's
/// sessions see it (see the guide's failure handling chapter, "Durability of the database"), with
/// the warnings a router gives at start-up about it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Durability {
    /// The sessions' `synchronous_commit` (server, database, role and
    /// connection settings together).
    pub synchronous_commit: String,
    /// What idem's transactions commit with: at least `on`.
    pub idem_commits_with: String,
    /// `synchronous_standby_names` (empty: none).
    pub synchronous_standby_names: String,
    /// The physical standbys streaming from the server: each
    /// `application_name` and `sync_state` (`None` where the role may not
    /// read it: grant `pg_monitor`).
    pub standbys: Vec<(String, Option<String>)>,
    /// What can still lose acked commits, or stop them: empty when nothing.
    pub warnings: Vec<String>,
}

/// Reads [`Durability`].
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// for warning in idem_runtime::status::durability(&pool).await?.warnings {
///     eprintln!("{warning}");
/// }
/// # Ok(())
/// # }
/// ```
pub async fn durability(pool: &PgPool) -> Result<Durability, sqlx::Error> {
    let settings = crate::store::durability::read(pool).await?;
    Ok(Durability {
        idem_commits_with: settings.commit_level().as_str().to_owned(),
        warnings: crate::store::durability::warnings(&settings),
        synchronous_commit: settings.synchronous_commit,
        synchronous_standby_names: settings.standby_names,
        standbys: settings.standbys,
    })
}

#[cfg(any(feature = "sqlite", feature = "mariadb"))]
/// A handler whose oldest claim outlived its retention by more than a
/// router's purge lets it: the purge is failing, or no router with a
/// retention (and no `idem purge`) runs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Overdue {
    /// The handler's name.
    pub handler: String,
    /// How long it keeps claims.
    pub retention: Duration,
    /// How old its oldest claim is.
    pub oldest_age: Duration,
    /// How long past its retention that claim is.
    pub overdue: Duration,
}

/// The handlers of `handlers` (as [`handlers`] reads
/// them) whose oldest claim is past its retention by more than two runs
/// of a router's purge and a second: on SQLite and MariaDB, where each purge
/// deletes the claims past their handler's retention, expiry is then behind (as
/// [`ExpiryStatus::behind`](ExpiryStatus::behind) says on
/// PostgreSQL). A router purges as often as its longest retention asks;
/// the longest of all handlers gives the most slack.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let handlers = idem_runtime::status::handlers(&pool).await?;
/// for late in idem_runtime::status::overdue(&handlers) {
///     eprintln!("{}: claims {:?} past their retention", late.handler, late.overdue);
/// }
/// # Ok(())
/// # }
/// ```
#[cfg(any(feature = "sqlite", feature = "mariadb"))]
pub fn overdue(handlers: &[HandlerStatus]) -> Vec<Overdue> {
    let Some(longest) = handlers
        .iter()
        .filter_map(|handler| handler.retention)
        .max()
    else {
        return Vec::new();
    };
    let slack = 2 * crate::store::purge::purge_interval(longest) + Duration::from_secs(1);
    handlers
        .iter()
        .filter_map(|handler| {
            let retention = handler.retention?;
            let oldest_age = handler.oldest_age?;
            let overdue = oldest_age.checked_sub(retention)?;
            (overdue > slack).then(|| Overdue {
                handler: handler.name.clone(),
                retention,
                oldest_age,
                overdue,
            })
        })
        .collect()
}

/// What `idem status` reads of a SQLite database besides its claims
/// (feature `sqlite`): how durable its commits are, whether its write lock
/// can be taken, which migration it is at, and the handlers whose claims
/// the purge is late to delete. SQLite has no server: these are read through
/// the pool's own connections, and what is a setting of each connection
/// (`synchronous`) is this pool's, not a service's.
///
/// ```no_run
/// # async fn f(pool: sqlx::SqlitePool) -> Result<(), sqlx::Error> {
/// use std::time::Duration;
/// use idem_runtime::status::sqlite::{self, WriteLock};
///
/// for warning in sqlite::durability(&pool).await?.warnings {
///     eprintln!("{warning}");
/// }
/// if let WriteLock::Held { waited } = sqlite::write_lock(&pool, Duration::from_secs(5)).await? {
///     eprintln!("the write lock stayed taken for {waited:?}: every claim waits");
/// }
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "sqlite")]
pub mod sqlite {
    use std::time::Duration;

    use sqlx::SqlitePool;

    pub use super::{Overdue, overdue};
    use crate::store::sqlite::Settings;
    pub use crate::store::sqlite::WriteLock;

    /// How durable SQLite makes the commits idem acks after, with the
    /// warnings a router's start-up gives about the same settings.
    #[derive(Debug, Clone, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct Durability {
        /// `journal_mode`, lower case: `wal` is kept in the file, so it is
        /// every connection's; any other mode is this pool's connections'.
        pub journal_mode: String,
        /// `synchronous` of this pool's connections: `off`, `normal`,
        /// `full` or `extra`. Each connection sets its own, so a service's
        /// may differ (its start-up warns when its own is below `full`).
        pub synchronous: String,
        /// What holds the file: `local`, `NFS (network)` (and the other
        /// network filesystems, where a router refuses to start), `FUSE`
        /// or `unknown`.
        pub filesystem: String,
        /// Each handler, with the settings of the router that registered it
        /// last: `synchronous` is each connection's own, so only a router
        /// knows its own.
        pub routers: Vec<RouterDurability>,
        /// What can lose acked commits, or slow them, on this pool's
        /// connections and on the routers': empty when nothing.
        pub warnings: Vec<String>,
    }

    /// The settings of the router that registered a handler last.
    #[derive(Debug, Clone, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct RouterDurability {
        /// The handler's name.
        pub handler: String,
        /// Its router's `journal_mode`, lower case.
        pub journal_mode: String,
        /// Its router's `synchronous`: `off`, `normal`, `full` or `extra`.
        pub synchronous: String,
        /// What can lose acked commits there, as the router's start-up warned.
        pub warnings: Vec<String>,
    }

    /// Reads [`Durability`] on one of `pool`'s connections.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    /// let durability = idem_runtime::status::sqlite::durability(&pool).await?;
    /// println!("journal_mode {}, synchronous {}", durability.journal_mode, durability.synchronous);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn durability(pool: &SqlitePool) -> Result<Durability, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let settings = Settings::read(&mut connection).await?;
        let mut warnings = settings.warnings("this command's");
        let mut routers = Vec::new();
        for (handler, journal_mode, synchronous) in
            crate::store::sqlite::router_settings(&mut connection).await?
        {
            // Registered before routers recorded their settings.
            let (Some(journal_mode), Some(synchronous)) = (journal_mode, synchronous) else {
                continue;
            };
            let theirs = Settings {
                journal_mode,
                synchronous,
                file: None,
                // The file's filesystem is this command's to report.
                filesystem: crate::store::sqlite::Filesystem::Local,
            };
            let router_warnings: Vec<String> = theirs
                .warnings(&format!("the router's (that registered `{handler}`)"))
                .into_iter()
                .filter(|warning| !warnings.contains(warning))
                .collect();
            warnings.extend(router_warnings.iter().cloned());
            routers.push(RouterDurability {
                handler,
                synchronous: theirs.synchronous_name(),
                journal_mode: theirs.journal_mode,
                warnings: router_warnings,
            });
        }
        Ok(Durability {
            warnings,
            routers,
            filesystem: settings.filesystem_name(),
            synchronous: settings.synchronous_name(),
            journal_mode: settings.journal_mode,
        })
    }

    /// Takes SQLite's write lock (`BEGIN IMMEDIATE`) on one of `pool`'s
    /// connections, waiting up to `wait` for it, and rolls back at once:
    /// nothing is written. A read-only connection's `BEGIN IMMEDIATE`
    /// takes no lock, so a write that changes nothing (`DELETE FROM
    /// idem_claims WHERE false`) tells one apart: the pool must be on a
    /// database with idem's schema. The connection is closed afterwards,
    /// since its busy timeout was changed for the probe.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    /// use idem_runtime::status::sqlite::{WriteLock, write_lock};
    ///
    /// let free = write_lock(&pool, std::time::Duration::from_secs(1)).await? == WriteLock::Free;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn write_lock(pool: &SqlitePool, wait: Duration) -> Result<WriteLock, sqlx::Error> {
        crate::store::sqlite::write_lock(pool, wait).await
    }

    /// The newest idem migration applied to the SQLite database, from
    /// idem's history table; `None` before the first.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    /// let version = idem_runtime::status::sqlite::schema_version(&pool).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn schema_version(pool: &SqlitePool) -> Result<Option<i64>, sqlx::Error> {
        crate::store::sqlite::schema_version(pool).await
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::status::HandlerStatus;

        fn handler(name: &str, retention: Option<u64>, oldest: Option<u64>) -> HandlerStatus {
            HandlerStatus {
                name: name.to_owned(),
                retention: retention.map(Duration::from_secs),
                claims: u64::from(oldest.is_some()),
                oldest_claim: None,
                oldest_age: oldest.map(Duration::from_secs),
            }
        }

        #[test]
        fn overdue_handlers_are_those_past_their_retention_and_the_purges_slack() {
            // An hour's retention: a purge every 60 s, so 121 s of slack.
            let handlers = [
                handler("kept", None, Some(100_000)),
                handler("empty", Some(3600), None),
                handler("young", Some(3600), Some(3600 + 121)),
                handler("late", Some(60), Some(60 + 122)),
            ];
            let late = overdue(&handlers);
            assert_eq!(late.len(), 1, "{late:?}");
            assert_eq!(late[0].handler, "late");
            assert_eq!(late[0].overdue, Duration::from_secs(122));
        }
    }
}

/// What operators read of MariaDB besides the claims (feature `mariadb`):
/// the settings that decide whether acked commits survive a crash, and the
/// schema's version. Expiry is read with [`overdue`], as on SQLite.
///
/// ```no_run
/// # async fn f(pool: sqlx::MySqlPool) -> Result<(), sqlx::Error> {
/// for warning in idem_runtime::status::mariadb::durability(&pool).await?.warnings {
///     eprintln!("{warning}");
/// }
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "mariadb")]
pub mod mariadb {
    use sqlx::MySqlPool;

    /// How durable MariaDB makes the commits idem acks after, with the
    /// warnings a router's start-up gives about the same settings.
    #[derive(Debug, Clone, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct Durability {
        /// The server's `VERSION()`.
        pub version: String,
        /// `innodb_flush_log_at_trx_commit`: 1 flushes the log at every
        /// commit.
        pub flush_log_at_trx_commit: i64,
        /// Whether the binary log is on.
        pub log_bin: bool,
        /// `sync_binlog`: 1 syncs the binary log at every commit.
        pub sync_binlog: i64,
        /// What can lose acked commits: empty when nothing.
        pub warnings: Vec<String>,
    }

    /// Reads [`Durability`] from the server.
    pub async fn durability(pool: &MySqlPool) -> Result<Durability, sqlx::Error> {
        let settings = crate::store::mariadb::Settings::read(pool).await?;
        Ok(Durability {
            warnings: settings.warnings(),
            version: settings.version,
            flush_log_at_trx_commit: settings.flush_log_at_trx_commit,
            log_bin: settings.log_bin != 0,
            sync_binlog: settings.sync_binlog,
        })
    }

    /// The newest idem migration applied to the database, from idem's
    /// history table; `None` before the first.
    pub async fn schema_version(pool: &MySqlPool) -> Result<Option<i64>, sqlx::Error> {
        crate::store::mariadb::schema_version(pool).await
    }
}
