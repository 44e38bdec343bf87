//! The suite, written once: [`compliance_suite!`] expands it into a module
//! for one store (`stores/<store>.rs`), whose pool, transaction and router
//! it takes. Everything else, the handlers' SQL included, is the same text
//! on every database (with `$n` placeholders, which a store whose database
//! takes `?` rewrites: `store::sql`).

/// The suite's handlers and tests, on the store `crate::stores::$store`.
macro_rules! compliance_suite {
    ($store:ident) => {
        use std::sync::{Arc, Mutex, OnceLock};
        use std::time::Duration;

        use idem_runtime::fault::{AfterCommit, FaultHooks};
        use idem_runtime::{
            BoxError, Delivery, Permanent, Route, Router, RouterHandle, State, Stats, Transient,
            idempotent,
        };
        use idem_tests::scenario::{
            Deposit, dead_letters, deposit, eventually, fast, header, publish, publish_with_id,
            stop, wait_all_acked, wait_pulling,
        };
        use idem_tests::{Batched, Batching};
        use tokio::task::JoinHandle;

        use crate::bed::{Bed, LEDGER, RECORD};
        use crate::stores::$store as store;
        use store::Tx;

        async fn bed(prefix: &str) -> Bed<store::Pool> {
            store::bed(prefix).await
        }

        /// Runs `router` on `pool` in the background until its handle stops it.
        fn spawn<S: Send + Sync + 'static>(
            router: Router<S, <store::Pool as PoolOf>::Database>,
            bed: &Bed<store::Pool>,
            pool: &store::Pool,
        ) -> (RouterHandle, JoinHandle<Result<(), idem_runtime::Error>>) {
            let handle = router.handle();
            let task = tokio::spawn(router.run_until(
                bed.nats.clone(),
                pool.clone(),
                std::future::pending(),
            ));
            (handle, task)
        }

        /// The database of a pool, to name a router's type.
        trait PoolOf {
            type Database;
        }

        impl<DB: sqlx::Database> PoolOf for sqlx::Pool<DB> {
            type Database = DB;
        }

        /// The effect every handler of the suite records.
        async fn record(
            tx: &mut Tx<'_>,
            handler: &str,
            delivery: &Delivery,
            d: &Deposit,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(store::sql(RECORD))
                .bind(handler)
                .bind(delivery.message_id().as_str())
                .bind(&d.account)
                .bind(d.amount)
                .bind(delivery.delivered() as i64)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        /// (effects, distinct messages) that `handler` applied.
        async fn ledger(bed: &Bed<store::Pool>, handler: &str) -> (i64, i64) {
            sqlx::query_as(store::sql(LEDGER))
                .bind(handler)
                .fetch_one(&bed.pool)
                .await
                .expect("the ledger reads")
        }

        /// Whether message `id`'s one effect was written by a delivery after
        /// its first.
        async fn applied_on_a_retry(bed: &Bed<store::Pool>, id: &str) -> bool {
            let delivered: Vec<i64> =
                sqlx::query_scalar(store::sql("SELECT delivered FROM effects WHERE msg_id = $1"))
                    .bind(id)
                    .fetch_all(&bed.pool)
                    .await
                    .expect("the effects read");
            delivered.len() == 1 && delivered[0] > 1
        }

        #[idempotent(name = "credit")]
        async fn credit(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            d: Deposit,
        ) -> Result<(), sqlx::Error> {
            record(tx, "credit", delivery, &d).await
        }

        #[idempotent(name = "credit-many", batch)]
        async fn credit_many(
            tx: &mut Tx<'_>,
            deliveries: &[Delivery],
            deposits: Vec<Deposit>,
        ) -> Result<(), sqlx::Error> {
            for (delivery, d) in deliveries.iter().zip(&deposits) {
                record(tx, "credit-many", delivery, d).await?;
            }
            Ok(())
        }

        // -------------------------------------------------------------------
        // A crash between COMMIT and ack.

        /// Every message commits and is then dropped unacked (the fault hook
        /// acts after COMMIT, as a process that dies there); a second
        /// worker gets the redeliveries, finds each claim and acks them as
        /// duplicates, running none. Effects = inputs, no duplicates.
        async fn committed_but_never_acked_applies_once<M, H>(
            prefix: &str,
            batching: Batching,
            handler: H,
            name: &str,
        ) where
            H: idem_runtime::IntoHandler<(), M, <store::Pool as PoolOf>::Database> + Copy,
        {
            const MESSAGES: usize = 20;
            let bed = bed(prefix).await;
            let route = || {
                fast(Route::new(&bed.stream, "c"))
                    .ack_wait(Duration::from_secs(2))
                    .batching(batching)
            };
            let published = bed.publish((0..MESSAGES).map(|i| format!("m-{i}"))).await;
            let first = store::router_with_state(())
                .route(route(), handler)
                .fault_hooks(FaultHooks::default().after_commit(|_| AfterCommit::DropWithoutAck));
            let (handle, task) = spawn(first, &bed, &bed.pool);
            let first_stats = handle.stats("c").unwrap();
            eventually(
                "every message committed and was dropped unacked",
                Duration::from_secs(30),
                || async { first_stats.dropped_by_fault() as usize == published },
            )
            .await;
            stop(handle, task).await;
            assert_eq!(
                ledger(&bed, name).await,
                (MESSAGES as i64, MESSAGES as i64),
                "committed once each before the crash"
            );

            let second = store::router_with_state(()).route(route(), handler);
            let (handle, task) = spawn(second, &bed, &bed.second_pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle.clone(), task).await;
            let second = handle.stats("c").unwrap();
            assert_eq!(
                (second.duplicates() as usize, second.processed()),
                (MESSAGES, 0),
                "every redelivery was a duplicate, none ran"
            );
            assert_eq!(
                ledger(&bed, name).await,
                (MESSAGES as i64, MESSAGES as i64),
                "effects = inputs, no duplicates"
            );
        }

        async fn committed_but_never_acked_is_applied_once(batching: Batching) {
            committed_but_never_acked_applies_once("CRASH", batching, credit, "credit").await;
        }

        /// As above for a batch handler on a route with default settings:
        /// its batches commit and are dropped; their redeliveries, in other
        /// batches, are all duplicates.
        #[tokio::test]
        async fn a_batch_handlers_commits_never_acked_are_applied_once() {
            committed_but_never_acked_applies_once(
                "CRASHMANY",
                Batching::Default,
                credit_many,
                "credit-many",
            )
            .await;
        }

        // -------------------------------------------------------------------
        // A redelivery racing the first attempt.

        /// Both workers' counters, for the first attempt to watch.
        #[derive(Clone, Default)]
        struct Workers(Arc<OnceLock<[Arc<Stats>; 2]>>);

        /// What the attempts saw.
        #[derive(Clone, Default)]
        struct Seen(Arc<Mutex<Vec<String>>>);

        /// A pool to look for lock waits with.
        #[derive(Clone, Default)]
        struct Probe(Arc<OnceLock<store::Pool>>);

        #[derive(Clone, Default, idem_runtime::FromRef)]
        struct RaceState {
            workers: Workers,
            seen: Seen,
            probe: Probe,
        }

        #[idempotent(name = "racer")]
        async fn racer(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            State(workers): State<Workers>,
            State(seen): State<Seen>,
            State(probe): State<Probe>,
            d: Deposit,
        ) -> Result<(), BoxError> {
            record(tx, "racer", delivery, &d).await?;
            if delivery.delivered() > 1 {
                seen.0
                    .lock()
                    .unwrap()
                    .push(format!("delivery {} ran the body", delivery.delivered()));
                return Ok(());
            }
            // Hold the claim until the redelivery (ack_wait expired,
            // heartbeats off) has been received by the other worker (this
            // one's only slot is taken), whose claim then waits for this
            // transaction to end.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let received = || {
                workers.0.get().map_or(0, |both| {
                    both.iter().map(|stats| stats.received()).sum::<u64>()
                })
            };
            while received() < 2 {
                if tokio::time::Instant::now() > deadline {
                    return Err("no redelivery reached the other worker within 30 s".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let pool = probe.0.get().expect("the probe's pool is set");
            let mut waits = store::someone_waits_for_a_lock(pool).await;
            while waits == Some(false) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
                waits = store::someone_waits_for_a_lock(pool).await;
            }
            if waits.is_none() {
                // Where a wait cannot be seen (SQLite's happens inside its
                // busy handler), hold the claim long enough for the
                // redelivery to reach its BEGIN: it must wait there, since
                // one that failed instead would be counted as held for the
                // database (the test checks none was).
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            seen.0.lock().unwrap().push(match waits {
                Some(true) => "the redelivery waited on the held claim".to_owned(),
                Some(false) => "the redelivery never waited on the held claim".to_owned(),
                None => "the redelivery arrived while the first attempt held its claim".to_owned(),
            });
            Ok(())
        }

        /// Two workers on one durable, each with one slot. The first attempt
        /// claims the message and holds its transaction open until the
        /// redelivery reaches the other worker and (where the database shows
        /// it) waits on the claim. That attempt finds the claim once the
        /// first commits: it is acked as a duplicate, and the body ran once.
        #[tokio::test]
        async fn a_redelivery_during_the_first_attempt_waits_then_skips() {
            let bed = bed("RACE").await;
            let route = || {
                fast(Route::new(&bed.stream, "c"))
                    .per_message()
                    .ack_wait(Duration::from_secs(1))
                    .without_heartbeat()
                    .allow_redelivery_while_running()
                    .concurrency(1)
            };
            let state = RaceState::default();
            let _ = state.probe.0.set(bed.pool.clone());
            let worker = |pool| {
                spawn(
                    store::router_with_state(state.clone()).route(route(), racer),
                    &bed,
                    pool,
                )
            };
            let (first, first_task) = worker(&bed.pool);
            let (second, second_task) = worker(&bed.second_pool);
            let both = [first.stats("c").unwrap(), second.stats("c").unwrap()];
            let _ = state.workers.0.set(both.clone());
            wait_pulling(&bed.js, &bed.stream, "c", 2).await;
            bed.publish(["race-1".to_owned()]).await;
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(first, first_task).await;
            stop(second, second_task).await;

            let seen = state.seen.0.lock().unwrap().clone();
            assert_eq!(seen.len(), 1, "one attempt ran the body: {seen:?}");
            assert_ne!(
                seen[0], "the redelivery never waited on the held claim",
                "the redelivery's claim waited for the first attempt"
            );
            let processed: u64 = both.iter().map(|stats| stats.processed()).sum();
            let duplicates: u64 = both.iter().map(|stats| stats.duplicates()).sum();
            let held: u64 = both.iter().map(|stats| stats.infrastructure_errors()).sum();
            assert_eq!(
                (processed, duplicates, held),
                (1, 1, 0),
                "the first attempt committed; the redelivery waited, then was a duplicate"
            );
            assert_eq!(ledger(&bed, "racer").await, (1, 1), "applied once");
        }

        // -------------------------------------------------------------------
        // Failures: each says what happens to its message.

        #[idempotent(name = "fails-first")]
        async fn fails_first(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            d: Deposit,
        ) -> Result<(), BoxError> {
            record(tx, "fails-first", delivery, &d).await?;
            if delivery.delivered() == 1 {
                return Err(Transient::new("the first attempt fails after its write").into());
            }
            Ok(())
        }

        /// A handler that fails after writing: its write and its claim roll
        /// back together, and the retry applies the message once.
        async fn a_failed_attempt_rolls_back_and_its_retry_applies_once(batching: Batching) {
            const MESSAGES: usize = 5;
            let bed = bed("FAIL").await;
            bed.publish((0..MESSAGES).map(|i| format!("f-{i}"))).await;
            let router = store::router_with_state(())
                .route(fast(Route::new(&bed.stream, "c")).batching(batching), fails_first);
            let (handle, task) = spawn(router, &bed, &bed.pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle.clone(), task).await;
            let stats = handle.stats("c").unwrap();
            assert_eq!(
                stats.processed() as usize,
                MESSAGES,
                "each applied after its failure"
            );
            assert!(stats.failed() as usize >= MESSAGES, "each failed at least once");
            assert_eq!(
                ledger(&bed, "fails-first").await,
                (MESSAGES as i64, MESSAGES as i64),
                "effects = inputs, no duplicates"
            );
        }

        idem_tests::in_every_mode!(
            batch = 8;
            committed_but_never_acked_is_applied_once,
            a_failed_attempt_rolls_back_and_its_retry_applies_once,
        );

        #[idempotent(name = "picky")]
        async fn picky(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
            record(tx, "picky", delivery, &d).await?;
            match d.account.as_str() {
                "refused" => Err(Permanent::new("this account refuses deposits").into()),
                "bomb" if delivery.delivered() == 1 => panic!("the handler hit a bug"),
                _ => Ok(()),
            }
        }

        /// Around a message that fails for good, one that panics once, and
        /// one whose payload does not decode, the rest flow. The permanent
        /// failure and the undecodable payload are dead-lettered at once
        /// with nothing applied; the panic rolls back and its retry applies
        /// once. Nothing is lost: every message is applied once or
        /// dead-lettered.
        #[tokio::test]
        async fn failures_cost_only_their_own_message_and_each_is_accounted_for() {
            let bed = bed("FAILURES").await;
            for (i, account) in ["ok", "refused", "ok", "bomb", "ok"].iter().enumerate() {
                publish(&bed.js, &bed.subject, &deposit(account, 1), Some(&format!("x-{i}")))
                    .await;
            }
            publish_with_id(&bed.js, &bed.subject, b"not a deposit".to_vec(), "x-garbled").await;
            let router = store::router_with_state(())
                .route(fast(Route::new(&bed.stream, "c")).max_deliver(3), picky);
            let (handle, task) = spawn(router, &bed, &bed.pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle.clone(), task).await;

            let mut letters: Vec<(String, String)> = dead_letters(&bed.js, &bed.stream)
                .await
                .iter()
                .map(|letter| {
                    (header(letter, "Idem-Message-Id"), header(letter, "Idem-Failure"))
                })
                .collect();
            letters.sort();
            assert_eq!(letters.len(), 2, "two dead letters: {letters:?}");
            assert_eq!(
                (letters[0].0.as_str(), letters[1].0.as_str()),
                ("x-1", "x-garbled"),
                "the refused and the garbled message: {letters:?}"
            );
            assert_eq!(letters[1].1, "undecodable", "{letters:?}");
            let refused: i64 =
                sqlx::query_scalar("SELECT count(*) FROM effects WHERE account = 'refused'")
                    .fetch_one(&bed.pool)
                    .await
                    .unwrap();
            assert_eq!(refused, 0, "the refused message's write rolled back");
            assert_eq!(
                ledger(&bed, "picky").await,
                (4, 4),
                "the other four applied once each, the panicking one on its retry"
            );
            let stats = handle.stats("c").unwrap();
            assert_eq!(
                (stats.processed(), stats.duplicates()),
                (4, 0),
                "the panicking attempt committed nothing: its retry ran the body"
            );
            assert!(
                applied_on_a_retry(&bed, "x-3").await,
                "the panicking message was applied by a later delivery"
            );
        }

        /// Commits its first chunk itself (a raw `COMMIT; BEGIN`), then fails
        /// on its first delivery.
        #[idempotent(name = "chunked")]
        async fn chunked(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            d: Deposit,
        ) -> Result<(), BoxError> {
            record(tx, "chunked-1", delivery, &d).await?;
            sqlx::raw_sql("COMMIT; BEGIN").execute(&mut **tx).await?;
            if delivery.delivered() == 1 {
                return Err(Transient::new("the second chunk failed").into());
            }
            record(tx, "chunked-2", delivery, &d).await?;
            Ok(())
        }

        /// A handler that ends the transaction itself has committed its claim
        /// with half its work. The runtime knows (`ClaimLost`): the message
        /// is dead-lettered, never acked half done as a duplicate.
        #[tokio::test]
        async fn a_handler_that_commits_by_itself_is_not_acked_half_done() {
            let bed = bed("CHUNK").await;
            bed.publish(["chunk-1".to_owned()]).await;
            let router = store::router_with_state(())
                .route(fast(Route::new(&bed.stream, "c")).per_message(), chunked);
            let (handle, task) = spawn(router, &bed, &bed.pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle.clone(), task).await;
            let stats = handle.stats("c").unwrap();
            let letters = dead_letters(&bed.js, &bed.stream).await;
            assert_eq!(
                (
                    stats.duplicates(),
                    letters.len(),
                    ledger(&bed, "chunked-1").await,
                    ledger(&bed, "chunked-2").await
                ),
                (0, 1, (1, 1), (0, 0)),
                "dead-lettered after its first chunk committed, never acked as a duplicate"
            );
        }

        // -------------------------------------------------------------------
        // A handler that does not end.

        #[idempotent(name = "runaway")]
        async fn runaway(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            d: Deposit,
        ) -> Result<(), BoxError> {
            record(tx, "runaway", delivery, &d).await?;
            if delivery.delivered() == 1 {
                match d.account.as_str() {
                    "statement" => {
                        sqlx::query(store::RUNAWAY).execute(&mut **tx).await?;
                    }
                    "sleeper" => tokio::time::sleep(Duration::from_secs(3600)).await,
                    _ => {}
                }
            }
            Ok(())
        }

        /// A statement that never ends, and a handler that never returns,
        /// would each hold their claim for ever and stop the messages behind
        /// them. Each is cut off at its handler's timeout, its transaction
        /// rolls back, and its retry applies it once; the messages behind
        /// go through.
        #[tokio::test]
        async fn a_handler_that_never_ends_is_cut_off_and_its_retry_applies_once() {
            let bed = bed("RUNAWAY").await;
            for (id, account) in [("s", "statement"), ("z", "sleeper")] {
                publish(&bed.js, &bed.subject, &deposit(account, 1), Some(id)).await;
            }
            bed.publish((0..3).map(|i| format!("behind-{i}"))).await;
            let route = fast(Route::new(&bed.stream, "c"))
                .per_message()
                .concurrency(1)
                .handler_timeout(Duration::from_secs(1));
            let (handle, task) =
                spawn(store::router_with_state(()).route(route, runaway), &bed, &bed.pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle.clone(), task).await;
            let stats = handle.stats("c").unwrap();
            assert!(stats.failed() >= 2, "both runaway attempts failed");
            assert!(
                dead_letters(&bed.js, &bed.stream).await.is_empty(),
                "nothing dead-lettered"
            );
            assert_eq!(
                ledger(&bed, "runaway").await,
                (5, 5),
                "every message applied once, the runaway ones too"
            );
            assert_eq!(
                (stats.processed(), stats.duplicates()),
                (5, 0),
                "the cut-off attempts committed nothing: their retries ran the body"
            );
            for id in ["s", "z"] {
                assert!(
                    applied_on_a_retry(&bed, id).await,
                    "{id} was applied by a later delivery than the one cut off"
                );
            }
        }

        // -------------------------------------------------------------------
        // Stored results.

        #[idempotent(name = "priced")]
        async fn priced(
            tx: &mut Tx<'_>,
            delivery: &Delivery,
            d: Deposit,
        ) -> Result<i64, sqlx::Error> {
            record(tx, "priced", delivery, &d).await?;
            Ok(d.amount * 100)
        }

        /// A handler's value is stored with its claim, in the same
        /// transaction, and read back by message id; a message never
        /// processed has none.
        #[tokio::test]
        async fn a_handlers_value_is_stored_with_its_claim() {
            let bed = bed("RESULT").await;
            publish(&bed.js, &bed.subject, &deposit("a", 7), Some("r-1")).await;
            let router =
                store::router_with_state(()).route(fast(Route::new(&bed.stream, "c")), priced);
            let (handle, task) = spawn(router, &bed, &bed.pool);
            wait_all_acked(&bed.js, &bed.stream, "c").await;
            stop(handle, task).await;
            let stored = idem_runtime::results::stored(&bed.pool, "priced", "r-1")
                .await
                .expect("the result reads");
            assert_eq!(stored.as_deref(), Some(&b"700"[..]), "the value, as JSON");
            let none = idem_runtime::results::stored(&bed.pool, "priced", "never-sent")
                .await
                .expect("the result reads");
            assert_eq!(none, None, "no claim, no value");
        }
    };
}

pub(crate) use compliance_suite;
