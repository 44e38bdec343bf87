//! Claims and purges by hand, for the expiry tests: handlers registered
//! without a router, the runtime's own claim statement run on a connection
//! the test holds, the purge run until it has done what a test waits for,
//! and a capture of the log lines a purge writes.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::__private::CLAIM_SQL;
use idem_runtime::expiry::{self, PurgeReport};
use idem_runtime::{Route, Unbounded};
use sqlx::{Connection, PgConnection, PgPool};

/// Registers handler `name` with `retention` by hand (a router does it at
/// start-up), returning its id.
pub async fn register(pool: &PgPool, name: &str, retention: Duration) -> i32 {
    sqlx::query_scalar(
        "INSERT INTO idem_handlers (name, retention)
         VALUES ($1, $2::bigint * interval '1 millisecond') RETURNING id",
    )
    .bind(name)
    .bind(retention.as_millis() as i64)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Registers handler `name` that keeps its claims forever, returning its id.
pub async fn register_forever(pool: &PgPool, name: &str) -> i32 {
    sqlx::query_scalar("INSERT INTO idem_handlers (name) VALUES ($1) RETURNING id")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The current generation and whether it is in transition.
pub async fn state(pool: &PgPool) -> (i32, bool) {
    sqlx::query_as("SELECT current_gen, transition FROM idem_dedup_state")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs the purge until `done` says its report is the one awaited.
pub async fn purge_until(
    pool: &PgPool,
    what: &str,
    mut done: impl FnMut(&PurgeReport) -> bool,
) -> PurgeReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report = expiry::purge(pool).await.unwrap();
        if done(&report) {
            return report;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Makes the current generation due for rotation at the next purge (as if
/// it had been current for an hour), and runs the purge until it rotates.
pub async fn rotate_now(pool: &PgPool) -> i32 {
    sqlx::query(
        "UPDATE idem_generations SET opened_at = now() - interval '1 hour'
          WHERE gen = (SELECT current_gen FROM idem_dedup_state)",
    )
    .execute(pool)
    .await
    .unwrap();
    purge_until(pool, "the table rotates", |r| r.rotated_to.is_some())
        .await
        .rotated_to
        .unwrap()
}

/// [`rotate_now`], then runs the purge until that rotation's transition
/// has ended (the rotating run itself ends it when it waits for nothing),
/// so that the generation before it is sealed. Returns the generation
/// rotated to.
pub async fn rotate_and_seal(pool: &PgPool) -> i32 {
    let rotated = rotate_now(pool).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while state(pool).await == (rotated, true) {
        assert!(Instant::now() < deadline, "the transition never ended");
        expiry::purge(pool).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rotated
}

/// The runtime's claim of `key` for handler `handler`, as one statement
/// with its parameters written in.
pub fn claim_sql(handler: i32, key: &str) -> sqlx::AssertSqlSafe<String> {
    assert!(key.chars().all(|c| c.is_ascii_hexdigit() || c == '-'));
    let sql = CLAIM_SQL
        .replace("$1", &handler.to_string())
        .replace("$2", &format!("'{key}'::uuid"))
        .replace("$3", "NULL::bigint");
    sqlx::AssertSqlSafe(sql)
}

/// A connection with a claim of `key` in an open transaction.
pub async fn claim_held(database_url: &str, handler: i32, key: &str) -> PgConnection {
    let mut conn = PgConnection::connect(database_url).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::raw_sql(claim_sql(handler, key))
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// Claims `key` in a transaction of its own and commits: `true` if it was
/// fresh, `false` if it was claimed before.
pub async fn claim_once(pool: &PgPool, handler: i32, key: &str) -> bool {
    let mut tx = pool.begin().await.unwrap();
    let claimed = sqlx::raw_sql(claim_sql(handler, key))
        .execute(&mut *tx)
        .await;
    match claimed {
        Ok(_) => {
            tx.commit().await.unwrap();
            true
        }
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505") => false,
        Err(other) => panic!("the claim failed: {other}"),
    }
}

/// The claim key of number `n`: a uuid in hex.
pub fn key(n: u64) -> String {
    format!("00000000-0000-0000-0000-{n:012x}")
}

/// The generations of the claims table that hold `key`, in order.
pub async fn generations_of(pool: &PgPool, key: &str) -> Vec<i32> {
    sqlx::query_scalar("SELECT gen FROM idem_claims WHERE key = $1::uuid ORDER BY gen")
        .bind(key)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Whether backend `pid` is waiting for a lock.
pub async fn waiting_on_a_lock(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
        .unwrap_or(false)
}

/// The backend of `conn`.
pub async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The partitions attached to the claims table, sorted by name.
pub async fn attached_partitions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT inhrelid::regclass::text FROM pg_inherits
          WHERE inhparent = 'idem_claims'::regclass ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A route whose retention floor is about 9 s with a publisher-retry
/// horizon of up to 1 s: a 1 s handler timeout, ack_wait 1 s, max_deliver
/// 3, NAK delays of 100 and 200 ms; the test streams keep messages forever
/// and the tests replay none, so it accepts that term.
pub fn short_retention_route(stream: &str, horizon: Duration, retention: Duration) -> Route {
    Route::new(stream, "c")
        .ack_wait(Duration::from_secs(1))
        .handler_timeout(Duration::from_secs(1))
        .max_deliver(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(200))
        .publisher_retry_horizon(horizon)
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
        .retention(retention)
}

/// The log lines written on this thread while it lives (a `#[tokio::test]`
/// runs every task it spawns on its one thread), at `info` and above.
pub struct LogCapture {
    lines: Arc<Mutex<Vec<u8>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    /// Starts capturing.
    pub fn start() -> LogCapture {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(lines.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        LogCapture {
            lines,
            _guard: tracing::subscriber::set_default(subscriber),
        }
    }

    /// The lines captured so far that contain every one of `needles`.
    pub fn lines_with(&self, needles: &[&str]) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.lines.lock().unwrap()).into_owned();
        text.lines()
            .filter(|line| needles.iter().all(|needle| line.contains(needle)))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for LogCapture {
    fn drop(&mut self) {
        // Echo what was captured into the test's own output, for failures.
        let text = self.lines.lock().unwrap();
        let _ = std::io::stderr().write_all(&text);
    }
}

/// A Prometheus recorder installed for this thread while it lives: the
/// metrics a router records on a `#[tokio::test]`'s one thread, rendered as
/// an exporter would serve them.
pub struct MetricsCapture {
    handle: metrics_exporter_prometheus::PrometheusHandle,
    _guard: metrics::LocalRecorderGuard<'static>,
}

impl MetricsCapture {
    /// Installs it (the recorder is leaked: one per test process).
    pub fn start() -> MetricsCapture {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let recorder: &'static _ = Box::leak(Box::new(recorder));
        MetricsCapture {
            handle,
            _guard: metrics::set_default_local_recorder(recorder),
        }
    }

    /// The value of the unlabelled metric `name`, if recorded.
    pub fn value(&self, name: &str) -> Option<f64> {
        self.handle.render().lines().find_map(|line| {
            let (metric, value) = line.split_once(' ')?;
            (metric == name).then(|| value.trim().parse().ok())?
        })
    }
}
