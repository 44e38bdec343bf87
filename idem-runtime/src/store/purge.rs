//! The PostgreSQL store's purge: the claims table's generations as
//! partitions of `idem_claims`, their rotation and transition, the expiry
//! of a generation in pieces, and the statements that read where expiry
//! stands. What it does, and why each step is safe to cut short, is told
//! for users in [`retention::expiry`](crate::retention::expiry), which
//! re-exports its public items: the protocol is PostgreSQL's as a whole
//! (partitions, the transition's wait on running snapshots, `DETACH ...
//! CONCURRENTLY`), so another database's store brings a purge of its own,
//! while what holds for any database (the floor, the status's shape) stays
//! in `retention/`.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::Error;
use crate::error::class::is_lock_timeout;

/// The key of the session advisory lock a purge holds.
pub(crate) const PURGE_LOCK: i64 = 0x6964_656d_5f65_7870; // "idem_exp"

/// How long a purge statement may wait for a lock before giving up for
/// this run.
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The database setting that sets the size of a generation's pieces, in
/// bytes (see *Pieces* in [`retention::expiry`](crate::retention::expiry)):
/// `ALTER DATABASE app SET idem.generation_piece_bytes = '16777216'`.
pub const PIECE_BYTES_SETTING: &str = "idem.generation_piece_bytes";

/// The size of a generation's pieces unless the database sets
/// [`PIECE_BYTES_SETTING`]: 64 MiB.
pub const DEFAULT_PIECE_BYTES: u64 = 64 << 20;

/// The most pieces a generation is made of: each is a partition that every
/// claim's plan holds a lock on.
pub const MAX_PIECES: u32 = 16;

/// After dropping a piece, the purge waits this many times as long as the
/// drop took, so that the disk spends about 1 % of the expiry freeing
/// blocks: few enough commits meet a drop that the p99 of the messages
/// around an expiry does not move (with 4, a fifth of the time, it did).
const PIECE_PAUSE_FACTOR: u32 = 100;

/// The longest pause between two pieces.
const MAX_PIECE_PAUSE: Duration = Duration::from_secs(10);

/// The `application_name` of a purge's session, as `pg_stat_activity`
/// shows it.
pub const APPLICATION_NAME: &str = "idem purge";

/// A transition that has lasted longer than this (or a generation length,
/// if shorter) is warned about.
const TRANSITION_WARN_AFTER: Duration = Duration::from_secs(60);

/// What one [`purge`](crate::retention::expiry::purge) run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Another purge held the lock: this one did nothing.
    pub skipped: bool,
    /// The longest retention a handler asks for; `None`: no handler lets
    /// its claims expire, so nothing rotates or expires.
    pub retention: Option<Duration>,
    /// The generation whose transition ended (and which is current, its
    /// predecessor sealed).
    pub transition_ended: Option<i32>,
    /// The generation rotated to.
    pub rotated_to: Option<i32>,
    /// The generations dropped and forgotten, including those whose expiry
    /// an earlier run began.
    pub expired: Vec<i32>,
    /// Claims copied into the kept partition (handlers without retention).
    pub kept: u64,
    /// Bytes of the dropped partitions, indexes included.
    pub freed_bytes: u64,
    /// Pieces of expired generations dropped one at a time (see
    /// [`pieces_for`]).
    pub pieces_dropped: u32,
    /// The transition still open after this run, with what it waits for.
    pub transition: Option<Transition>,
    /// Claims deleted one by one, on a database without generations
    /// (SQLite); always 0 on PostgreSQL.
    pub deleted: u64,
}

/// A rotation in transition: claims go into two generations until it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Transition {
    /// The generation rotated to (current).
    pub generation: i32,
    /// How long ago the rotation committed, by the database's clock.
    pub waited: Duration,
    /// The transactions it still waits for, as recorded by the last purge
    /// run (their details are in `blockers` where they were read).
    pub waiting_for: usize,
    /// Those transactions, as the database shows them now.
    pub blockers: Vec<Blocker>,
}

use crate::error::retention::seconds;
use crate::error::retention::{Blocker, Holds, PurgeFailure};

/// How long a generation is current: half the retention, so that a claim
/// lives between the retention and one and a half times it (and at least a
/// second, so that tests with tiny retentions still rotate sanely).
pub fn generation_length(retention: Duration) -> Duration {
    (retention / 2).max(Duration::from_secs(1))
}

/// How often a router's background purge runs for `retention`.
pub(crate) fn purge_interval(retention: Duration) -> Duration {
    (generation_length(retention) / 4).clamp(Duration::from_millis(250), Duration::from_secs(60))
}

/// How long a transition may last before each run warns about it: a
/// generation length (after which the next rotation is late), at most a
/// minute.
pub fn transition_warn_after(retention: Option<Duration>) -> Duration {
    retention.map_or(TRANSITION_WARN_AFTER, |retention| {
        generation_length(retention).min(TRANSITION_WARN_AFTER)
    })
}

/// Runs the expiry once: finishes an expiry an earlier run began, ends a
/// transition that can end, rotates if the current generation is due, and
/// expires what is past the retention (see
/// [`retention::expiry`](crate::retention::expiry)). Safe to run from any
/// number of processes at once: all but one skip. Records its outcome for
/// [`status::expiry`](crate::status::expiry).
pub async fn purge(pool: &PgPool) -> Result<PurgeReport, Error> {
    purge_with(pool, &Stop::default()).await
}

/// Runs [`purge`](crate::retention::expiry::purge) and ends its session, with `pg_terminate_backend` from
/// another session, when it reaches `step`: what a SIGKILL, a failover or a
/// cancelled task does to a purge at that point. The purge then fails at
/// its next statement, as it would.
#[cfg(feature = "fault-injection")]
pub async fn purge_ending_session_at(pool: &PgPool, step: Step) -> Result<PurgeReport, Error> {
    purge_with(
        pool,
        &Stop {
            at: Some((step, pool.clone())),
        },
    )
    .await
}

/// A point in a purge between two of its steps, where a test can end the
/// purge's session ([`purge_ending_session_at`]).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// The next generation's partition is created and attached; the
    /// rotation to it has not committed.
    Attached,
    /// The rotation committed; the transactions its transition waits for
    /// are not recorded yet.
    Rotated,
    /// A due generation's claims of handlers without retention are copied
    /// into the kept partition; it is still attached.
    Copied,
    /// A due generation is detached; its partition is not dropped yet.
    Detached,
    /// One piece of a detached generation is dropped, the others not yet
    /// (the first piece, when the generation has more than one).
    PieceDropped,
}

/// The steps [`Stop`] knows, also without the `fault-injection` feature.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Clone, Copy)]
enum Step {
    Attached,
    Rotated,
    Copied,
    Detached,
    PieceDropped,
}

/// Where a purge ends its own session, for tests; nothing without the
/// `fault-injection` feature.
#[derive(Default)]
struct Stop {
    #[cfg(feature = "fault-injection")]
    at: Option<(Step, PgPool)>,
}

impl Stop {
    #[cfg(not(feature = "fault-injection"))]
    async fn reached(&self, _: &mut PgConnection, _: Step) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// Ends the session of `conn` if the purge is to stop at `step`.
    #[cfg(feature = "fault-injection")]
    async fn reached(&self, conn: &mut PgConnection, step: Step) -> Result<(), sqlx::Error> {
        let Some((at, pool)) = &self.at else {
            return Ok(());
        };
        if *at != step {
            return Ok(());
        }
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await?;
        // Waits (up to 10 s) until the backend has exited.
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
            .bind(pid)
            .fetch_one(pool)
            .await?;
        assert!(ended, "the purge's backend {pid} did not exit");
        tracing::info!(?step, pid, "fault injection: the purge's session ended");
        Ok(())
    }
}

async fn purge_with(pool: &PgPool, stop: &Stop) -> Result<PurgeReport, Error> {
    // A session of its own, so that its advisory lock ends with it, and a
    // run cut short (a cancelled task) never hands a pooled connection back
    // halfway through DDL. Named, so that an operator sees it for what it is.
    let options = purge_options(pool.connect_options().as_ref());
    let mut conn = PgConnection::connect_with(&options).await?;
    // Set after connecting, not as startup parameters, which some poolers
    // (PgBouncer) refuse.
    sqlx::query(
        "SELECT set_config('idle_session_timeout', $1, false),
                set_config('idle_in_transaction_session_timeout', $1, false)",
    )
    .bind(format!("{}ms", SESSION_IDLE_TIMEOUT.as_millis()))
    .execute(&mut conn)
    .await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(PURGE_LOCK)
        .fetch_one(&mut conn)
        .await?;
    if !locked {
        let _ = conn.close().await;
        return Ok(PurgeReport {
            skipped: true,
            ..PurgeReport::default()
        });
    }
    let mut purge = Purge {
        conn: &mut conn,
        report: PurgeReport::default(),
        stop,
    };
    let outcome = purge.run().await;
    let report = std::mem::take(&mut purge.report);
    record_outcome(&mut conn, pool, outcome.as_ref().err()).await;
    // Closing ends the session, and the lock with it.
    let _ = conn.close().await;
    outcome.map(|()| report)
}

/// How long the server keeps a purge's session that sends nothing, idle
/// or idle in a transaction, before it ends it: a session whose process
/// froze, or whose network went away without a reset, would otherwise hold
/// the purge's advisory lock (and every later purge would be skipped)
/// until TCP keepalive gives up, hours later. A run never pauses between
/// its statements for anywhere near this long.
pub(crate) const SESSION_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The pool's connect options, with the purge's `application_name` (after
/// the application's own, if it set one).
fn purge_options(options: &PgConnectOptions) -> PgConnectOptions {
    let name = match options.get_application_name() {
        Some(own) if !own.is_empty() => format!("{own} ({APPLICATION_NAME})"),
        _ => APPLICATION_NAME.to_owned(),
    };
    options.clone().application_name(&name)
}

/// Records how a run ended in `idem_expiry_state`, on the purge's session,
/// or, if that is gone (the failure may have been its end), on the pool. A
/// database that cannot be reached at all is not recorded: the failure is
/// logged and counted by the caller all the same.
async fn record_outcome(conn: &mut PgConnection, pool: &PgPool, failure: Option<&Error>) {
    let recorded = match failure {
        None => sqlx::query("UPDATE idem_expiry_state SET last_success_at = now(), failures = 0")
            .execute(&mut *conn)
            .await
            .map(drop),
        Some(error) => {
            let text = error.to_string();
            let record = "UPDATE idem_expiry_state
                             SET last_failure_at = now(), last_error = $1, failures = failures + 1";
            match sqlx::query(record).bind(&text).execute(&mut *conn).await {
                Ok(_) => Ok(()),
                Err(_) => sqlx::query(record)
                    .bind(&text)
                    .execute(pool)
                    .await
                    .map(drop),
            }
        }
    };
    if let Err(error) = recorded {
        tracing::debug!(%error, "the purge's outcome could not be recorded");
    }
}

/// One run, on its locked session.
struct Purge<'a> {
    conn: &'a mut PgConnection,
    report: PurgeReport,
    stop: &'a Stop,
}

/// Where a generation's partition stands, from the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Partition {
    Attached,
    /// `DETACH ... CONCURRENTLY` committed its first step only.
    DetachPending,
    /// A table of its own, not yet dropped.
    Detached,
    Gone,
}

impl Purge<'_> {
    /// The steps of a run. One that fails does not stop the steps that do
    /// not depend on it: an expiry held up by a lock (a pending detach
    /// blocks every other) must not stop the rotation, nor the end of a
    /// transition. The first failure is returned.
    async fn run(&mut self) -> Result<(), Error> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET lock_timeout = '{}ms'",
            LOCK_TIMEOUT.as_millis()
        )))
        .execute(&mut *self.conn)
        .await?;
        self.report.retention = self
            .retention()
            .await
            .map_err(failed("reading the retention"))?;
        let mut failure = self.resume_expiries().await.err();
        let expiring = failure.is_none();
        keep_first(&mut failure, self.end_transition().await);
        let Some(retention) = self.report.retention else {
            return failure.map_or(Ok(()), Err);
        };
        keep_first(
            &mut failure,
            self.rotate_if_due(generation_length(retention)).await,
        );
        if self.report.rotated_to.is_some() {
            // At once, so that what it waits for is known from the start
            // (and a transition that waits for nothing ends now).
            keep_first(&mut failure, self.end_transition().await);
        }
        if expiring {
            keep_first(&mut failure, self.expire_due(retention).await);
        }
        failure.map_or(Ok(()), Err)
    }

    /// Expires the generations sealed longer than `retention` ago, oldest
    /// first, up to the first that fails.
    async fn expire_due(&mut self, retention: Duration) -> Result<(), Error> {
        let due: Vec<i32> = sqlx::query_scalar(
            "SELECT gen FROM idem_generations
              WHERE sealed_at <= now() - $1::bigint * interval '1 millisecond'
              ORDER BY gen",
        )
        .bind(millis(retention))
        .fetch_all(&mut *self.conn)
        .await
        .map_err(failed("reading the generations due"))?;
        for generation in due {
            self.expire(generation).await?;
        }
        Ok(())
    }

    /// [`failed`], and for a lock timeout, with the transactions
    /// older than the timeout that hold locks on the claims table.
    async fn failed_waiting(&mut self, step: String, source: sqlx::Error) -> Error {
        let lock_holders = if is_lock_timeout(&source) {
            lock_holders(self.conn).await.unwrap_or_default()
        } else {
            Vec::new()
        };
        Error::Purge(PurgeFailure {
            step,
            source,
            lock_holders,
        })
    }

    /// The longest retention a registered handler asks for.
    async fn retention(&mut self) -> Result<Option<Duration>, sqlx::Error> {
        let millis: Option<i64> = sqlx::query_scalar(
            "SELECT (extract(epoch FROM max(retention)) * 1000)::bigint FROM idem_handlers",
        )
        .fetch_one(&mut *self.conn)
        .await?;
        Ok(millis.map(|millis| Duration::from_millis(millis.max(0).unsigned_abs())))
    }

    /// Finishes every expiry an earlier run began and did not end: sealed
    /// generations whose partition is no longer attached, and detaches left
    /// pending.
    async fn resume_expiries(&mut self) -> Result<(), Error> {
        let begun: Vec<i32> = sqlx::query_scalar(
            "SELECT g.gen FROM idem_generations g
              WHERE g.sealed_at IS NOT NULL
                AND NOT EXISTS (SELECT FROM pg_inherits i
                                 WHERE i.inhparent = 'idem_claims'::regclass
                                   AND i.inhrelid = to_regclass('idem_claims_g' || g.gen)
                                   AND NOT i.inhdetachpending)
             UNION
             SELECT substring(c.relname FROM '^idem_claims_g([0-9]+)$')::integer
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'idem_claims'::regclass AND i.inhdetachpending
                AND c.relname ~ '^idem_claims_g[0-9]+$'
             ORDER BY 1",
        )
        .fetch_all(&mut *self.conn)
        .await
        .map_err(failed("looking for expiries left unfinished"))?;
        for generation in begun {
            tracing::info!(
                generation,
                "finishing the expiry of a claims generation that an earlier purge began"
            );
            self.expire(generation).await?;
        }
        Ok(())
    }

    /// Ends the transition if no transaction it waits for can still claim
    /// into the older generation (see *What a transition waits for* in
    /// [`retention::expiry`](crate::retention::expiry)); records those
    /// transactions first if a run cut short left them unrecorded.
    async fn end_transition(&mut self) -> Result<(), Error> {
        let (current, transition, recorded, waited): (i32, bool, bool, Option<f64>) =
            sqlx::query_as(
                "SELECT s.current_gen, s.transition, s.waiting_for IS NOT NULL,
                        extract(epoch FROM now() - g.opened_at)::float8
                   FROM idem_dedup_state s LEFT JOIN idem_generations g ON g.gen = s.current_gen",
            )
            .fetch_one(&mut *self.conn)
            .await
            .map_err(failed("reading the generation state"))?;
        if !transition {
            return Ok(());
        }
        let step = || format!("ending the transition to generation {current}");
        if !recorded {
            record_running_transactions(self.conn)
                .await
                .map_err(failed(step()))?;
        }
        let still = match still_blocking(self.conn).await {
            Ok(still) => still,
            Err(error) => return Err(self.failed_waiting(step(), error).await),
        };
        if still.is_empty() {
            let sealed = seal(self.conn, current).await.map_err(failed(step()))?;
            if sealed {
                tracing::info!(
                    generation = current,
                    "claims generation transition ended; the previous one is sealed"
                );
                self.report.transition_ended = Some(current);
            }
            return Ok(());
        }
        let vxids: Vec<&str> = still.iter().map(|(vxid, ..)| vxid.as_str()).collect();
        sqlx::query(
            "UPDATE idem_dedup_state SET waiting_for = $2
              WHERE transition AND current_gen = $1 AND waiting_for IS DISTINCT FROM $2",
        )
        .bind(current)
        .bind(&vxids)
        .execute(&mut *self.conn)
        .await
        .map_err(failed(step()))?;
        let blockers = describe_blockers(self.conn, &still)
            .await
            .map_err(failed(step()))?;
        let waited = Duration::from_secs_f64(waited.unwrap_or(0.0).max(0.0));
        if waited >= transition_warn_after(self.report.retention) {
            let list: Vec<String> = blockers.iter().map(Blocker::to_string).collect();
            tracing::warn!(
                generation = current,
                waited_s = waited.as_secs(),
                "a claims generation transition has waited {} for {} transaction(s) that may still claim with a view from before the rotation: claims go into two generations, and no rotation follows, until they end: {}",
                seconds(waited),
                blockers.len(),
                list.join("; ")
            );
        } else {
            tracing::debug!(
                generation = current,
                waiting = blockers.len(),
                "a claims generation transition waits"
            );
        }
        self.report.transition = Some(Transition {
            generation: current,
            waited,
            waiting_for: still.len(),
            blockers,
        });
        Ok(())
    }

    /// Opens the next generation if the current one has been current for
    /// `length` and is not in transition.
    async fn rotate_if_due(&mut self, length: Duration) -> Result<(), Error> {
        let due: Option<i32> = sqlx::query_scalar(
            "SELECT s.current_gen + 1 FROM idem_dedup_state s
               JOIN idem_generations g ON g.gen = s.current_gen
              WHERE NOT s.transition AND g.opened_at <= now() - $1::bigint * interval '1 millisecond'",
        )
        .bind(millis(length))
        .fetch_optional(&mut *self.conn)
        .await
        .map_err(failed("reading whether a rotation is due"))?;
        let Some(next) = due else {
            return Ok(());
        };
        let step = || format!("rotating to generation {next}");
        // Attached before it becomes current, as a table of its own first:
        // CREATE TABLE ... PARTITION OF would lock the parent ACCESS EXCLUSIVE.
        // A run that crashed after attaching finds it attached and goes on.
        if self.partition(next).await.map_err(failed(step()))? != Partition::Attached {
            let pieces = self.pieces_for_next(next).await.map_err(failed(step()))?;
            // One message, one implicit transaction: all of it or none.
            let attached = sqlx::raw_sql(sqlx::AssertSqlSafe(create_generation(next, pieces)))
                .execute(&mut *self.conn)
                .await;
            if let Err(error) = attached {
                return Err(self.failed_waiting(step(), error).await);
            }
        }
        self.stop
            .reached(self.conn, Step::Attached)
            .await
            .map_err(failed(step()))?;
        let mut tx = self.conn.begin().await.map_err(failed(step()))?;
        sqlx::query("INSERT INTO idem_generations (gen) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(next)
            .execute(&mut *tx)
            .await
            .map_err(failed(step()))?;
        // The rotating transaction's id: a snapshot newer than it sees the
        // rotation (see *What a transition waits for* in `retention::expiry`).
        sqlx::query(
            "UPDATE idem_expiry_state SET rotated_gen = $1, rotated_xid = pg_current_xact_id()",
        )
        .bind(next)
        .execute(&mut *tx)
        .await
        .map_err(failed(step()))?;
        sqlx::query(
            "UPDATE idem_dedup_state SET current_gen = $1, transition = true, waiting_for = NULL",
        )
        .bind(next)
        .execute(&mut *tx)
        .await
        .map_err(failed(step()))?;
        tx.commit().await.map_err(failed(step()))?;
        self.stop
            .reached(self.conn, Step::Rotated)
            .await
            .map_err(failed(step()))?;
        record_running_transactions(self.conn)
            .await
            .map_err(failed(step()))?;
        tracing::info!(generation = next, "claims generation rotated");
        self.report.rotated_to = Some(next);
        Ok(())
    }

    /// How many pieces generation `next` gets: enough for pieces of the
    /// database's piece size (see *Pieces* in
    /// [`retention::expiry`](crate::retention::expiry)) at the size its
    /// predecessor, the current generation, has now.
    async fn pieces_for_next(&mut self, next: i32) -> Result<u32, sqlx::Error> {
        let (bytes, setting): (i64, Option<String>) = sqlx::query_as(
            "SELECT (SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::int8
                       FROM pg_partition_tree(to_regclass($1))),
                    current_setting($2, true)",
        )
        .bind(partition_name(next - 1))
        .bind(PIECE_BYTES_SETTING)
        .fetch_one(&mut *self.conn)
        .await?;
        let piece_bytes = match setting.as_deref().map(str::trim) {
            None | Some("") => DEFAULT_PIECE_BYTES,
            Some(text) => match text.parse::<u64>() {
                Ok(piece_bytes) if piece_bytes > 0 => piece_bytes,
                _ => {
                    tracing::warn!(
                        setting = PIECE_BYTES_SETTING,
                        value = text,
                        "the claims generations' piece size is not a positive number of bytes; using the default, {DEFAULT_PIECE_BYTES}"
                    );
                    DEFAULT_PIECE_BYTES
                }
            },
        };
        Ok(pieces_for(bytes.max(0).unsigned_abs(), piece_bytes))
    }

    /// Where generation `generation`'s partition stands.
    async fn partition(&mut self, generation: i32) -> Result<Partition, sqlx::Error> {
        let (exists, pending): (bool, Option<bool>) = sqlx::query_as(
            "SELECT to_regclass($1) IS NOT NULL,
                    (SELECT inhdetachpending FROM pg_inherits
                      WHERE inhparent = 'idem_claims'::regclass AND inhrelid = to_regclass($1))",
        )
        .bind(partition_name(generation))
        .fetch_one(&mut *self.conn)
        .await?;
        Ok(match (exists, pending) {
            (false, _) => Partition::Gone,
            (true, None) => Partition::Detached,
            (true, Some(true)) => Partition::DetachPending,
            (true, Some(false)) => Partition::Attached,
        })
    }

    /// Moves the claims of handlers without retention out of generation
    /// `generation` into the kept partition, then detaches, drops and
    /// forgets it, going on from wherever an earlier run left it.
    async fn expire(&mut self, generation: i32) -> Result<(), Error> {
        let partition = partition_name(generation);
        let step = |what: &str| format!("{what} generation {generation}");
        let mut copied = false;
        loop {
            let state = self
                .partition(generation)
                .await
                .map_err(failed(step("expiring")))?;
            match state {
                Partition::Attached => {
                    self.copy_kept(generation)
                        .await
                        .map_err(failed(step("copying the kept claims of")))?;
                    copied = true;
                    self.stop
                        .reached(self.conn, Step::Copied)
                        .await
                        .map_err(failed(step("detaching")))?;
                    // Not in a transaction: DETACH ... CONCURRENTLY commits in
                    // two steps, waiting in between for transactions that may
                    // still read it. Cut short between them, it is left
                    // pending.
                    let detached = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "ALTER TABLE idem_claims DETACH PARTITION {partition} CONCURRENTLY"
                    )))
                    .execute(&mut *self.conn)
                    .await;
                    if let Err(error) = detached {
                        return Err(self.failed_waiting(step("detaching"), error).await);
                    }
                    self.stop
                        .reached(self.conn, Step::Detached)
                        .await
                        .map_err(failed(step("dropping")))?;
                }
                Partition::DetachPending => {
                    let finalized = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "ALTER TABLE idem_claims DETACH PARTITION {partition} FINALIZE"
                    )))
                    .execute(&mut *self.conn)
                    .await;
                    if let Err(error) = finalized {
                        return Err(self
                            .failed_waiting(step("finishing the detach of"), error)
                            .await);
                    }
                }
                Partition::Detached => {
                    // A run cut short after the detach copied before it; the
                    // copy is repeated all the same (it is idempotent), so
                    // that no state, whoever left it, loses a kept claim.
                    if !copied {
                        self.copy_kept(generation)
                            .await
                            .map_err(failed(step("copying the kept claims of")))?;
                    }
                    let mut freed = self.drop_pieces(generation).await?;
                    let bytes = self.drop_and_forget(generation).await;
                    match bytes {
                        Ok(bytes) => freed += bytes,
                        Err(error) => {
                            return Err(self.failed_waiting(step("dropping"), error).await);
                        }
                    }
                    self.expired(generation, freed);
                    return Ok(());
                }
                Partition::Gone => {
                    sqlx::query("DELETE FROM idem_generations WHERE gen = $1")
                        .bind(generation)
                        .execute(&mut *self.conn)
                        .await
                        .map_err(failed(step("forgetting")))?;
                    self.expired(generation, 0);
                    return Ok(());
                }
            }
        }
    }

    /// Copies generation `generation`'s claims of handlers without
    /// retention into the kept partition (those already there are skipped).
    async fn copy_kept(&mut self, generation: i32) -> Result<(), sqlx::Error> {
        let kept = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idem_claims (key, gen, handler_id, claimed_at, result)
             SELECT key, 0, handler_id, claimed_at, result FROM {}
              WHERE handler_id IN (SELECT id FROM idem_handlers WHERE retention IS NULL)
             ON CONFLICT DO NOTHING",
            partition_name(generation)
        )))
        .execute(&mut *self.conn)
        .await?
        .rows_affected();
        self.report.kept += kept;
        Ok(())
    }

    /// Drops the pieces of generation `generation`'s detached partition, if
    /// it has any (see *Pieces* in
    /// [`retention::expiry`](crate::retention::expiry)), one per statement
    /// and so one unlink at a time, pausing after each but the last
    /// [`PIECE_PAUSE_FACTOR`] times as long as its drop took; returns the
    /// bytes they held.
    async fn drop_pieces(&mut self, generation: i32) -> Result<u64, Error> {
        let step = || format!("dropping the pieces of generation {generation}");
        let pieces: Vec<(String, i64)> = sqlx::query_as(
            "SELECT c.relname::text, pg_total_relation_size(c.oid)
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = to_regclass($1)
              ORDER BY c.relname",
        )
        .bind(partition_name(generation))
        .fetch_all(&mut *self.conn)
        .await
        .map_err(failed(step()))?;
        // An expiry takes at most about a quarter of a generation, so that
        // it never makes the next one late.
        let count = u32::try_from(pieces.len()).unwrap_or(u32::MAX).max(1);
        let at_most = self
            .report
            .retention
            .map_or(MAX_PIECE_PAUSE, |retention| {
                generation_length(retention) / count / 4
            })
            .min(MAX_PIECE_PAUSE);
        let last = pieces.len().saturating_sub(1);
        let mut freed = 0;
        for (i, (piece, bytes)) in pieces.into_iter().enumerate() {
            // Named by the rotation: nothing to quote, checked all the same.
            if !is_piece_of(&piece, generation) {
                return Err(failed(step())(sqlx::Error::Protocol(format!(
                    "`{piece}` is attached to generation {generation}'s partition, but is not a piece the purge made"
                ))));
            }
            let started = Instant::now();
            let dropped = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {piece}")))
                .execute(&mut *self.conn)
                .await;
            if let Err(error) = dropped {
                return Err(self.failed_waiting(step(), error).await);
            }
            let took = started.elapsed();
            let bytes = bytes.max(0).unsigned_abs();
            freed += bytes;
            self.report.pieces_dropped += 1;
            tracing::debug!(
                generation,
                piece,
                bytes,
                ?took,
                "claims generation piece dropped"
            );
            self.stop
                .reached(self.conn, Step::PieceDropped)
                .await
                .map_err(failed(step()))?;
            if i < last {
                tokio::time::sleep(piece_pause(took, at_most)).await;
            }
        }
        Ok(freed)
    }

    /// Drops generation `generation`'s detached partition and forgets the
    /// generation, in one transaction; returns the bytes it held.
    async fn drop_and_forget(&mut self, generation: i32) -> Result<u64, sqlx::Error> {
        let partition = partition_name(generation);
        let bytes: Option<i64> =
            sqlx::query_scalar("SELECT pg_total_relation_size(to_regclass($1))")
                .bind(&partition)
                .fetch_one(&mut *self.conn)
                .await?;
        let mut tx = self.conn.begin().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {partition}"
        )))
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM idem_generations WHERE gen = $1")
            .bind(generation)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(bytes.unwrap_or(0).max(0).unsigned_abs())
    }

    fn expired(&mut self, generation: i32, bytes: u64) {
        self.report.expired.push(generation);
        self.report.freed_bytes += bytes;
        tracing::info!(generation, bytes, "claims generation expired");
    }
}

/// Keeps the first of a run's failures.
fn keep_first(failure: &mut Option<Error>, outcome: Result<(), Error>) {
    if let Err(error) = outcome {
        failure.get_or_insert(error);
    }
}

/// Wraps a failed statement of `step` with what the purge was doing.
fn failed(step: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
    let step = step.into();
    move |source| {
        Error::Purge(PurgeFailure {
            step,
            source,
            lock_holders: Vec::new(),
        })
    }
}

/// The claims table and its partitions, as a subquery of OIDs.
const CLAIMS_RELATIONS: &str = "(SELECT 'idem_claims'::regclass::oid
                                 UNION ALL SELECT inhrelid FROM pg_inherits
                                            WHERE inhparent = 'idem_claims'::regclass)";

/// The lock modes a transaction holds on a table it writes (or may write).
const WRITE_MODES: &str =
    "('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')";

/// This database's OID, as a subquery.
const THIS_DATABASE: &str = "(SELECT oid FROM pg_database WHERE datname = current_database())";

/// Backends of a database that cannot run a claim: autovacuum's. (A
/// logical replication connection can run SQL, so a `walsender` counts.)
const NOT_CLAIMING: &str = "('autovacuum worker', 'autovacuum launcher')";

/// Records the transactions of this database running now, which the
/// transition waits for unless they cannot claim into the older generation
/// (see [`still_blocking`]). Taken after the rotation committed: a claim that saw
/// the old state began before that, so it is among them unless it has
/// ended. Prepared transactions holding a write lock on the claims table
/// are recorded too.
async fn record_running_transactions(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE idem_dedup_state
            SET waiting_for = (
                SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{{}}')
                  FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE (l.locktype = 'virtualxid' AND l.pid <> pg_backend_pid()
                        AND a.datid = {THIS_DATABASE} AND a.backend_type NOT IN {NOT_CLAIMING})
                    OR (l.pid IS NULL AND l.locktype = 'relation'
                        AND l.database = {THIS_DATABASE} AND l.relation IN {CLAIMS_RELATIONS}
                        AND l.mode IN {WRITE_MODES}))
          WHERE transition AND waiting_for IS NULL"
    )))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The recorded transactions that still hold the transition, each with its
/// backend (none for a prepared transaction) and why: those still running
/// that hold a write lock on the claims table, or whose backend holds a
/// snapshot that may predate the rotation. The snapshots are read first:
/// a transaction without a snapshot then and without a lock after began no
/// claim before the first read, and any it begins later sees the rotation.
pub(crate) async fn still_blocking(
    conn: &mut PgConnection,
) -> Result<Vec<(String, Option<i32>, Holds)>, sqlx::Error> {
    // A snapshot predates the rotation's commit only if the rotating
    // transaction was running when it was taken: then its xmin is at or
    // before that transaction's id. `age` compares the two around the
    // 32-bit wraparound. Without a recorded id for the current generation
    // (an older runtime rotated to it), every snapshot counts.
    let old_snapshots: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT a.pid FROM pg_stat_activity a
          WHERE a.datid = {THIS_DATABASE} AND a.pid <> pg_backend_pid()
            AND a.backend_type NOT IN {NOT_CLAIMING}
            AND a.backend_xmin IS NOT NULL
            AND coalesce((SELECT age(a.backend_xmin) >= age(e.rotated_xid::xid)
                            FROM idem_dedup_state s, idem_expiry_state e
                           WHERE e.rotated_gen = s.current_gen),
                         true)"
    )))
    .fetch_all(&mut *conn)
    .await?;
    let recorded: Vec<(String, Option<i32>, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT w.vxid, min(l.pid),
                coalesce(bool_or(l.locktype = 'relation' AND l.database = {THIS_DATABASE}
                                 AND l.relation IN {CLAIMS_RELATIONS}
                                 AND l.mode IN {WRITE_MODES}), false)
           FROM unnest((SELECT waiting_for FROM idem_dedup_state)) AS w(vxid)
           JOIN pg_locks l ON l.virtualtransaction = w.vxid
          GROUP BY w.vxid
          ORDER BY w.vxid"
    )))
    .fetch_all(&mut *conn)
    .await?;
    Ok(recorded
        .into_iter()
        .filter_map(|(vxid, pid, claims)| {
            let holds = if claims {
                Holds::Claims
            } else if pid.is_some_and(|pid| old_snapshots.contains(&pid)) {
                Holds::Snapshot
            } else {
                return None;
            };
            Some((vxid, pid, holds))
        })
        .collect())
}

/// What the database shows of each transaction in `still` (from
/// [`still_blocking`]).
pub(crate) async fn describe_blockers(
    conn: &mut PgConnection,
    still: &[(String, Option<i32>, Holds)],
) -> Result<Vec<Blocker>, sqlx::Error> {
    let vxids: Vec<&str> = still.iter().map(|(vxid, ..)| vxid.as_str()).collect();
    let rows = details(conn, &vxids).await?;
    Ok(still
        .iter()
        .map(|(vxid, pid, holds)| {
            let mut blocker = rows
                .iter()
                .find(|(row_vxid, ..)| row_vxid == vxid)
                .map(|(_, blocker)| blocker.clone())
                .unwrap_or_else(|| Blocker::ended(*pid));
            blocker.holds = *holds;
            blocker
        })
        .collect())
}

type DetailRow = (
    String,
    Option<i32>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<f64>,
    Option<f64>,
    Option<String>,
);

/// `pg_stat_activity`'s view of the backends running `vxids` (or
/// `pg_prepared_xacts`'s, for prepared transactions).
async fn details(
    conn: &mut PgConnection,
    vxids: &[&str],
) -> Result<Vec<(String, Blocker)>, sqlx::Error> {
    let rows: Vec<DetailRow> = sqlx::query_as(
        "SELECT v.vxid, a.pid, p.gid, coalesce(a.datname, p.database), a.application_name, a.state,
                extract(epoch FROM now() - coalesce(a.xact_start, p.prepared))::float8,
                extract(epoch FROM now() - a.query_start)::float8,
                left(a.query, 120)
           FROM unnest($1::text[]) AS v(vxid)
           LEFT JOIN LATERAL (SELECT pid, transactionid FROM pg_locks l
                               WHERE l.virtualtransaction = v.vxid
                               ORDER BY l.locktype = 'transactionid' DESC LIMIT 1) l ON true
           LEFT JOIN pg_stat_activity a ON a.pid = l.pid
           LEFT JOIN pg_prepared_xacts p ON l.pid IS NULL AND p.transaction = l.transactionid",
    )
    .bind(vxids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(vxid, pid, prepared, database, application_name, state, xact, query_age, query)| {
                let blocker = Blocker {
                    pid,
                    prepared,
                    database,
                    application_name,
                    state,
                    transaction_age: xact.map(non_negative),
                    query_age: query_age.map(non_negative),
                    query,
                    holds: Holds::Claims,
                };
                (vxid, blocker)
            },
        )
        .collect())
}

/// The transactions, older than the lock timeout, that hold locks on the
/// claims table: what a purge statement that timed out on a lock waited
/// for, most likely.
async fn lock_holders(conn: &mut PgConnection) -> Result<Vec<Blocker>, sqlx::Error> {
    let vxids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT DISTINCT l.virtualtransaction FROM pg_locks l
           LEFT JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'relation' AND l.database = {THIS_DATABASE}
            AND l.relation IN {CLAIMS_RELATIONS} AND l.granted
            AND l.pid IS DISTINCT FROM pg_backend_pid()
            AND (a.xact_start IS NULL OR a.xact_start < now() - $1::bigint * interval '1 millisecond')
          ORDER BY 1"
    )))
    .bind(millis(LOCK_TIMEOUT))
    .fetch_all(&mut *conn)
    .await?;
    let vxids: Vec<&str> = vxids.iter().map(String::as_str).collect();
    Ok(details(conn, &vxids)
        .await?
        .into_iter()
        .map(|(_, mut blocker)| {
            blocker.holds = Holds::Lock;
            blocker
        })
        .collect())
}

fn non_negative(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)
}

/// Ends the transition to generation `current` and seals the one before;
/// false if it had ended already (another purge, between the reads).
async fn seal(conn: &mut PgConnection, current: i32) -> Result<bool, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let ended = sqlx::query(
        "UPDATE idem_dedup_state SET transition = false, waiting_for = NULL
          WHERE transition AND current_gen = $1",
    )
    .bind(current)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if ended {
        sqlx::query("UPDATE idem_generations SET sealed_at = now() WHERE gen = $1 - 1")
            .bind(current)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(ended)
}

/// The partition of generation `generation` (a number: nothing to quote).
fn partition_name(generation: i32) -> String {
    format!("idem_claims_g{generation}")
}

/// Piece `piece` of generation `generation`'s partition.
fn piece_name(generation: i32, piece: u32) -> String {
    format!("idem_claims_g{generation}_p{piece}")
}

/// Whether `name` is a piece of generation `generation`, as
/// [`piece_name`] names them.
fn is_piece_of(name: &str, generation: i32) -> bool {
    name.strip_prefix(&format!("idem_claims_g{generation}_p"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The statements that create generation `generation`'s partition, in
/// `pieces` pieces (hash partitions of the key) if more than one, and
/// attach it to the claims table. As a table of its own first: `CREATE
/// TABLE ... PARTITION OF` would lock the parent `ACCESS EXCLUSIVE`.
fn create_generation(generation: i32, pieces: u32) -> String {
    let partition = partition_name(generation);
    let mut sql = format!(
        "DROP TABLE IF EXISTS {partition};
         CREATE TABLE {partition} (LIKE idem_claims INCLUDING DEFAULTS,
                                   CHECK (gen = {generation}))"
    );
    if pieces > 1 {
        sql.push_str(" PARTITION BY HASH (key);");
        for piece in 0..pieces {
            let name = piece_name(generation, piece);
            sql.push_str(&format!(
                "\nCREATE TABLE {name} PARTITION OF {partition}
                   FOR VALUES WITH (MODULUS {pieces}, REMAINDER {piece});"
            ));
        }
    } else {
        sql.push(';');
    }
    sql.push_str(&format!(
        "\nALTER TABLE idem_claims ATTACH PARTITION {partition} FOR VALUES IN ({generation});"
    ));
    sql
}

/// The pieces of a generation whose predecessor holds `bytes`, for pieces
/// of `piece_bytes`: as many as it takes, between 1 and [`MAX_PIECES`].
///
/// ```
/// use idem_runtime::retention::expiry::pieces_for;
///
/// const MIB: u64 = 1 << 20;
/// assert_eq!(pieces_for(10 * MIB, 64 * MIB), 1);
/// assert_eq!(pieces_for(1075 * MIB, 64 * MIB), 16); // 10M claims
/// assert_eq!(pieces_for(100 * 1024 * MIB, 64 * MIB), 16); // at most
/// ```
pub fn pieces_for(bytes: u64, piece_bytes: u64) -> u32 {
    let pieces = bytes
        .div_ceil(piece_bytes.max(1))
        .clamp(1, u64::from(MAX_PIECES));
    u32::try_from(pieces).unwrap_or(MAX_PIECES)
}

/// How long the purge pauses after dropping a piece that took `took`, at
/// most `at_most`.
fn piece_pause(took: Duration, at_most: Duration) -> Duration {
    took.saturating_mul(PIECE_PAUSE_FACTOR).min(at_most)
}

pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A row of [`figures`]: the retention (ms), the current generation, whether
/// it is in transition and how many transactions that waits for (as the
/// last run recorded), the current generation's age (s), the generations,
/// those due and how long ago the oldest of them was sealed and how far
/// past its expiry it is (s), and the purge runs' record (the last
/// success's time and age, failures in a row, the last error, its age).
pub(crate) type Figures = (
    Option<i64>,
    i32,
    bool,
    Option<i32>,
    Option<f64>,
    i64,
    i64,
    Option<f64>,
    Option<f64>,
    Option<f64>,
    Option<f64>,
    i64,
    Option<String>,
    Option<f64>,
);

/// Where expiry stands, in one cheap query (what
/// [`status::expiry`](crate::status::expiry) shows, and the gauges read).
pub(crate) async fn figures(pool: &PgPool) -> Result<Figures, sqlx::Error> {
    sqlx::query_as(
        "WITH r AS (SELECT max(retention) AS retention FROM idem_handlers),
              due AS (SELECT g.sealed_at FROM idem_generations g, r
                       WHERE g.sealed_at <= now() - r.retention)
         SELECT (extract(epoch FROM r.retention) * 1000)::bigint,
                s.current_gen, s.transition, cardinality(s.waiting_for),
                extract(epoch FROM now() - cur.opened_at)::float8,
                (SELECT count(*) FROM idem_generations),
                (SELECT count(*) FROM due),
                extract(epoch FROM now() - (SELECT min(sealed_at) FROM due))::float8,
                extract(epoch FROM now() - (SELECT min(sealed_at) FROM due) - r.retention)::float8,
                extract(epoch FROM e.last_success_at)::float8,
                extract(epoch FROM now() - e.last_success_at)::float8,
                e.failures,
                CASE WHEN e.failures > 0 THEN e.last_error END,
                extract(epoch FROM now() - e.last_failure_at)::float8
           FROM r, idem_dedup_state s
           LEFT JOIN idem_generations cur ON cur.gen = s.current_gen
           CROSS JOIN idem_expiry_state e",
    )
    .fetch_one(pool)
    .await
}

/// A session holding the purge's lock: pid, `application_name`, state,
/// seconds in that state, its query.
type Holder = (
    i32,
    Option<String>,
    Option<String>,
    Option<f64>,
    Option<String>,
);

/// The session holding the purge's lock, described (pid, application,
/// state and for how long, its query), if it sends nothing or has been in
/// one state for longer than `slack`: one that is working (a long DETACH, a
/// first run after a long downtime expiring many generations) is not
/// returned.
pub(crate) async fn idle_lock_holder(
    pool: &PgPool,
    slack: Duration,
) -> Result<Option<String>, sqlx::Error> {
    let holder: Option<Holder> = sqlx::query_as(
        "SELECT a.pid, a.application_name, a.state,
                extract(epoch FROM now() - a.state_change)::float8, left(a.query, 120)
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.granted
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.objsubid = 1 AND ((l.classid::bigint << 32) | l.objid::bigint) = $1
            AND (a.state IS DISTINCT FROM 'active'
                 OR a.state_change < now() - $2::bigint * interval '1 millisecond')
          LIMIT 1",
    )
    .bind(PURGE_LOCK)
    .bind(millis(slack))
    .fetch_optional(pool)
    .await?;
    Ok(holder.map(|(pid, application, state, age, query)| {
        format!(
            "pid {pid} ({}, {} for {:.0}s): {}",
            application.unwrap_or_default(),
            state.unwrap_or_default(),
            age.unwrap_or_default(),
            query.unwrap_or_default()
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_is_half_the_retention() {
        assert_eq!(
            generation_length(Duration::from_secs(7 * 86_400)),
            Duration::from_secs(302_400)
        );
        assert_eq!(
            generation_length(Duration::from_millis(10)),
            Duration::from_secs(1)
        );
        assert_eq!(
            purge_interval(Duration::from_secs(7 * 86_400)),
            Duration::from_secs(60)
        );
        assert_eq!(
            purge_interval(Duration::from_secs(2)),
            Duration::from_millis(250)
        );
    }

    #[test]
    fn a_transition_is_warned_about_after_a_generation_at_most_a_minute() {
        assert_eq!(
            transition_warn_after(Some(Duration::from_secs(7 * 86_400))),
            Duration::from_secs(60)
        );
        assert_eq!(
            transition_warn_after(Some(Duration::from_secs(10))),
            Duration::from_secs(5)
        );
        assert_eq!(transition_warn_after(None), Duration::from_secs(60));
    }

    #[test]
    fn a_blocker_names_its_backend_and_why() {
        let blocker = Blocker {
            pid: Some(4242),
            prepared: None,
            database: Some("app".into()),
            application_name: Some("psql".into()),
            state: Some("idle in transaction".into()),
            transaction_age: Some(Duration::from_millis(183_250)),
            query_age: Some(Duration::from_secs(180)),
            query: Some("SELECT count(*)\n  FROM orders".into()),
            holds: Holds::Snapshot,
        };
        assert_eq!(
            blocker.to_string(),
            "pid 4242 in database `app` (application `psql`, idle in transaction, transaction 183.2 s old, query started 180.0 s ago: `SELECT count(*) FROM orders`): holds a snapshot that may predate the rotation"
        );
        let prepared = Blocker {
            prepared: Some("tx-7".into()),
            ..Blocker::ended(None)
        };
        assert_eq!(
            prepared.to_string(),
            "prepared transaction `tx-7`: holds claims not yet committed"
        );
    }
}
