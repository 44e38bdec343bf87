//! Adaptive batching ([`Route::adaptive_batch`]) and the fallback: an idle
//! route runs each message alone, a backlog grows the batches, and a
//! failing message runs alone while its neighbours still commit in
//! batches.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use idem_runtime::{Delivery, Permanent, Route, Router, State, idempotent};
use idem_tests::scenario::*;

#[idempotent(name = "adaptive")]
async fn adaptive(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "adaptive", &d, delivery).await
}

/// Messages that arrive one at a time, each after the last was acked, run
/// one per transaction: none waits for a batch to fill.
#[tokio::test]
async fn an_idle_adaptive_route_runs_each_message_alone() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ADAPTIDLE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").adaptive_batch(64), adaptive),
        nats,
        pool.clone(),
    );
    const MESSAGES: i64 = 5;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: "a".into(),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("idle-{i}"))).await;
        wait_all_acked(&js, &stream, "c").await;
    }
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), MESSAGES as u64);
    assert_eq!(
        stats.batches(),
        0,
        "no message that came alone ran as a batch: {stats:?}"
    );
    assert_eq!(ledger(&pool, "adaptive").await, Ledger::once_each(MESSAGES));
}

/// A backlog waiting when the route starts is taken in batches that grow
/// past one message, and every message is still applied once.
#[tokio::test]
async fn under_a_backlog_an_adaptive_route_grows_its_batches() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ADAPTGROW", Duration::from_secs(120)).await;
    const MESSAGES: i64 = 600;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: format!("acct-{}", i % 50),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("grow-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c").adaptive_batch(64).concurrency(2),
            adaptive,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), MESSAGES as u64, "{stats:?}");
    assert!(
        stats.largest_batch() >= 8,
        "the batches grew under the backlog: {stats:?}"
    );
    assert!(stats.largest_batch() <= 64, "never past the cap: {stats:?}");
    assert_eq!(stats.batch_fallbacks(), 0);
    assert_eq!(ledger(&pool, "adaptive").await, Ledger::once_each(MESSAGES));
}

/// What the `around` handler saw: how many claims the bad message's first
/// transaction held (the size of the batch it failed), and how many times
/// each message's handler ran.
#[derive(Clone, Default)]
struct Seen {
    batch: Arc<Mutex<Option<i64>>>,
    calls: Arc<Mutex<std::collections::BTreeMap<i64, u32>>>,
}

impl Seen {
    fn calls(&self) -> std::collections::BTreeMap<i64, u32> {
        self.calls.lock().unwrap().clone()
    }
}

#[idempotent(name = "around")]
async fn around(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(seen): State<Seen>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    *seen.calls.lock().unwrap().entry(d.amount).or_default() += 1;
    if d.account == "bad" {
        let claims: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_claims WHERE xmin = pg_current_xact_id()::xid",
        )
        .fetch_one(&mut **tx)
        .await?;
        seen.batch.lock().unwrap().get_or_insert(claims);
        return Err(Permanent::new("this account refuses deposits").into());
    }
    record_effect(tx, "around", &d, delivery).await?;
    Ok(())
}

/// Publishes 8 deposits, those at `bad` to the refusing account, and runs
/// them in one batch of 8 (they are published before the route starts,
/// which has one slot) until all are acked. Returns the route's counters,
/// the pool, and the servers (which stop when dropped).
async fn run_a_batch_of_eight(
    prefix: &str,
    bad: &[i64],
    seen: &Seen,
) -> (
    std::sync::Arc<idem_runtime::Stats>,
    sqlx::PgPool,
    idem_tests::TestEnv,
) {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario(prefix, Duration::from_secs(120)).await;
    for i in 0..8 {
        let account = if bad.contains(&i) { "bad" } else { "ok" };
        let deposit = Deposit {
            account: account.into(),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("h-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::with_state(seen.clone())
            .route(Route::new(&stream, "c").batch(8).concurrency(1), around),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let batch = seen.batch.lock().unwrap().expect("a bad message ran");
    assert_eq!(
        batch, 8,
        "the first bad message failed in a batch of all 8 (published before the route started)"
    );
    (handle.stats("c").unwrap(), pool, env)
}

/// A batch of 8 whose fourth message fails for good: the three before it
/// commit again as one batch, the bad one runs alone (and is
/// dead-lettered), and the four after it commit as one batch: the 7 good
/// neighbours take 2 transactions where one per message would take 7, and
/// no handler but the bad one's runs more than twice.
#[tokio::test]
async fn a_failing_message_runs_alone_and_its_neighbours_in_two_batches() {
    let seen = Seen::default();
    let (stats, pool, _env) = run_a_batch_of_eight("AROUND", &[3], &seen).await;
    assert_eq!(
        (stats.processed(), stats.dead_lettered()),
        (7, 1),
        "{stats:?}"
    );
    assert_eq!(stats.batch_fallbacks(), 1, "{stats:?}");
    assert_eq!(ledger(&pool, "around").await, Ledger::once_each(7));
    let transactions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM effects WHERE handler = 'around'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        transactions, 2,
        "the 7 good neighbours committed in [0..3) and [4..8)"
    );
    // Before the bad one: ran in the failed batch and in their own. After
    // it: never ran in the failed batch. The bad one: in the batch, alone.
    let calls = seen.calls();
    assert_eq!(
        calls.values().copied().collect::<Vec<_>>(),
        [2, 2, 2, 2, 1, 1, 1, 1],
        "{calls:?}"
    );
}

/// Every message of a batch of 8 fails (a dependency is down, say): after
/// the batch and the batch of the rest both fail at their first message,
/// the rest run one per transaction: 8 + 2 handler calls, not a cascade of
/// batches each running the handlers again.
#[tokio::test]
async fn when_every_message_fails_the_batch_falls_back_to_one_per_transaction_at_once() {
    let seen = Seen::default();
    let (stats, _pool, _env) =
        run_a_batch_of_eight("ALLFAIL", &[0, 1, 2, 3, 4, 5, 6, 7], &seen).await;
    assert_eq!(
        (stats.processed(), stats.dead_lettered()),
        (0, 8),
        "{stats:?}"
    );
    let calls = seen.calls();
    assert_eq!(
        calls.values().sum::<u32>(),
        10,
        "each message once alone, the first two also in a batch: {calls:?}"
    );
    assert_eq!(calls[&0], 2, "{calls:?}");
    assert_eq!(calls[&1], 2, "{calls:?}");
}

/// Whether a `waits_for_row` call saw its statement fail on the batch's
/// lock timeout (55P03).
#[derive(Clone, Default)]
struct RowWaits {
    timed_out: Arc<std::sync::atomic::AtomicBool>,
}

#[idempotent(name = "waits-for-row")]
async fn waits_for_row(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(waits): State<RowWaits>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    let locked = sqlx::query("SELECT id FROM hot_row WHERE id = 1 FOR UPDATE")
        .execute(&mut **tx)
        .await;
    if let Err(sqlx::Error::Database(error)) = &locked
        && error.code().as_deref() == Some("55P03")
    {
        waits
            .timed_out
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    locked?;
    record_effect(tx, "waits-for-row", &d, delivery).await
}

/// Creates `hot_row` with its one row, which [`waits_for_row`] locks, and
/// holds that row locked until the returned transaction ends.
async fn hold_hot_row(pool: &sqlx::PgPool) -> sqlx::PgTransaction<'static> {
    sqlx::raw_sql("CREATE TABLE hot_row (id int PRIMARY KEY); INSERT INTO hot_row VALUES (1)")
        .execute(pool)
        .await
        .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM hot_row WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// A row another transaction holds for longer than an adaptive batch waits
/// for a lock (200 ms): the batch's statement fails with 55P03 instead of
/// waiting (as it would behind a deadlock, until PostgreSQL's
/// `deadlock_timeout`), the batch counts as a conflict, and its messages run
/// one per transaction, which wait for the row as long as it takes. When
/// the row is free, every message is applied once.
#[tokio::test]
async fn a_batch_waiting_on_a_row_lock_gives_up_at_once_and_its_messages_wait_alone() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ROWWAIT", Duration::from_secs(120)).await;
    let holder = hold_hot_row(&pool).await;
    const MESSAGES: i64 = 6;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("w-{i}"))).await;
    }
    let waits = RowWaits::default();
    let (handle, task) = spawn(
        Router::with_state(waits.clone())
            .route(Route::new(&stream, "c").concurrency(1), waits_for_row),
        nats,
        pool.clone(),
    );
    eventually(
        "a batch's statement gave up on the row lock (55P03)",
        Duration::from_secs(30),
        || async { waits.timed_out.load(std::sync::atomic::Ordering::SeqCst) },
    )
    .await;
    let stats = handle.stats("c").unwrap();
    eventually("the batch fell back", Duration::from_secs(10), || async {
        stats.batch_fallbacks() >= 1
    })
    .await;
    // Alone, its first message now waits for the row: nothing is applied
    // while the lock is held.
    assert_eq!(stats.processed(), 0, "{stats:?}");
    holder.commit().await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(stats.processed(), MESSAGES as u64, "{stats:?}");
    assert_eq!(
        ledger(&pool, "waits-for-row").await,
        Ledger::once_each(MESSAGES)
    );
}

/// While a route runs one batch at a time after a conflict, what its pull
/// fetched ahead waits leased, not for ack_wait to pass. ack_wait is 2 s
/// and the route may hold 8 messages unacked; a batch of 2 gives up on a
/// row lock the test holds, and its messages wait for the row one per
/// transaction. Six more are fetched meanwhile (8 unacked: the server
/// sends no more). For three times ack_wait the test pulls from the same
/// consumer, as a second worker would: it can only be given a message
/// whose ack_wait ran out, and it is given none. Once the row is free, each
/// message is applied once.
#[tokio::test]
async fn messages_fetched_ahead_while_a_conflicted_batch_runs_are_kept_leased() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("AHEAD", Duration::from_secs(120)).await;
    let holder = hold_hot_row(&pool).await;
    for i in 0..2 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("f-{i}"))).await;
    }
    let ack_wait = Duration::from_secs(2);
    let waits = RowWaits::default();
    let (handle, task) = spawn(
        Router::with_state(waits.clone()).route(
            Route::new(&stream, "c")
                .concurrency(2)
                .ack_wait(ack_wait)
                .max_ack_pending(8),
            waits_for_row,
        ),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    eventually(
        "the batch of 2 gave up on the row lock and fell back",
        Duration::from_secs(30),
        || async {
            waits.timed_out.load(std::sync::atomic::Ordering::SeqCst)
                && stats.batch_fallbacks() >= 1
        },
    )
    .await;
    const MESSAGES: i64 = 8;
    for i in 2..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("f-{i}"))).await;
    }
    eventually(
        "the route fetched all eight",
        Duration::from_secs(10),
        || async { env.consumer_info(&stream, "c").await.num_ack_pending == 8 },
    )
    .await;
    assert_eq!(stats.processed(), 0, "the row is still held: {stats:?}");
    let consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer("c")
        .await
        .unwrap();
    let watch_until = tokio::time::Instant::now() + 3 * ack_wait;
    let mut redelivered = Vec::new();
    while tokio::time::Instant::now() < watch_until {
        let mut fetched = consumer
            .fetch()
            .max_messages(1)
            .expires(ack_wait / 4)
            .messages()
            .await
            .unwrap();
        while let Some(Ok(message)) = fetched.next().await {
            // Left unacked: the route takes it again after ack_wait.
            redelivered.push(message.info().unwrap().stream_sequence);
        }
    }
    assert!(
        redelivered.is_empty(),
        "no fetched message waited unleased past ack_wait: stream sequences {redelivered:?} were delivered again"
    );
    assert_eq!(
        stats.processed(),
        0,
        "the row was held throughout: {stats:?}"
    );

    holder.commit().await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        ledger(&pool, "waits-for-row").await,
        Ledger::once_each(MESSAGES)
    );
}

#[idempotent(name = "some-wait-for-row")]
async fn some_wait_for_row(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if d.account == "hot" {
        sqlx::query("SELECT id FROM hot_row WHERE id = 1 FOR UPDATE")
            .execute(&mut **tx)
            .await?;
    }
    record_effect(tx, "some-wait-for-row", &d, delivery).await
}

/// A lone batch that fell back after a conflict, its messages waiting for
/// a row another session holds, does not stop its route. Two messages that
/// lock the held row run as a batch, which gives up on the lock and falls
/// back; they then wait for the row one per transaction, and no longer
/// count as a batch. Four that touch no held row come next: they are
/// applied while the row is still held. (In ae6e978 the route started
/// nothing until the lone batch ended, that is until the row was free; in
/// a9470f3, nothing until the hold that limits it to one batch at a time
/// ended.)
#[tokio::test]
async fn a_lone_batch_waiting_on_a_held_row_does_not_stop_its_route() {
    cold_messages_pass_hot_ones_waiting_alone("LONE", 2, 2, 4).await;
}

/// Batches that fall back after a conflict, their messages waiting alone
/// for a row another session holds, do not stop their route: messages that
/// touch no held row keep being applied on its other slots. Four messages
/// that lock the held row run as two batches of 2 on a route of four
/// slots; both give up on the lock (one conflict) and fall back, their
/// messages waiting one per transaction, on two slots. Eight that touch no
/// held row come next: they must all be applied while the row is held.
/// (Before, batches in fallback still counted among the batches the route
/// let run after a conflict, one until the hold ended and two after: it
/// started nothing more until the row was free.)
#[tokio::test]
async fn batches_waiting_alone_on_a_held_row_leave_their_route_free_for_the_rest() {
    cold_messages_pass_hot_ones_waiting_alone("MIXED", 4, 4, 8).await;
}

/// `hot` messages that lock a held row, published before a route of
/// `slots` slots starts, run as batches of 2, which give up on the lock
/// and fall back (the test checks that they did); then `cold` messages
/// that touch no held row must all be applied while the row is still held.
/// Once it is free, every message is applied once.
async fn cold_messages_pass_hot_ones_waiting_alone(
    prefix: &str,
    hot: i64,
    slots: usize,
    cold: i64,
) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario(prefix, Duration::from_secs(120)).await;
    let holder = hold_hot_row(&pool).await;
    for i in 0..hot {
        publish(&js, &subject, &deposit("hot", i), Some(&format!("hot-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c").concurrency(slots),
            some_wait_for_row,
        ),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    let batches = (hot / 2) as u64;
    eventually(
        "the batches of 2 gave up on the row lock and fell back",
        Duration::from_secs(30),
        || async { stats.batch_fallbacks() >= batches },
    )
    .await;
    assert_eq!(
        (stats.received(), stats.batch_fallbacks()),
        (hot as u64, batches),
        "the hot messages ran as batches of 2, which fell back: {stats:?}"
    );
    for i in 0..cold {
        publish(
            &js,
            &subject,
            &deposit("cold", i),
            Some(&format!("cold-{i}")),
        )
        .await;
    }
    eventually(
        "the messages that touch no held row are applied while the row is held",
        Duration::from_secs(20),
        || async { stats.processed() == cold as u64 },
    )
    .await;
    let applied_hot: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM effects WHERE handler = 'some-wait-for-row' AND account = 'hot'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        applied_hot, 0,
        "the row is still held, so nothing hot is applied"
    );

    holder.commit().await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        ledger(&pool, "some-wait-for-row").await,
        Ledger::once_each(hot + cold)
    );
}
