//! The outbox's part of the suite, written once: [`outbox_suite!`] expands
//! it beside [`compliance_suite!`](crate::suite::compliance_suite) in each
//! store's module, whose items (`bed`, `spawn`, `ledger`, `record`, `store`)
//! it uses. Each database relays its own way (PostgreSQL and MariaDB with
//! row locks, SQLite with leases); what is checked is the promise:
//!
//! - what a handler queues is published once, after its commit, whatever
//!   its retries and redeliveries did; what it queued and rolled back is
//!   never published;
//! - a row that cannot be published fails on its own, is reported, and goes
//!   out once its cause is fixed and it is retried;
//! - a relay that dies between its PubAcks and its DELETE leaves its rows to
//!   the next relay, which republishes them once (JetStream drops the
//!   copies);
//! - two relays on one database never take the same row.

/// The outbox tests, on the store `crate::stores::$store`.
macro_rules! outbox_suite {
    () => {
        mod outbox {
            use std::collections::HashSet;
            use std::sync::Arc;
            use std::sync::atomic::{AtomicUsize, Ordering};
            use std::time::Duration;

            use idem_runtime::fault::{AfterCommit, AfterPubAcks, FaultHooks};
            use idem_runtime::outbox::{self, Outbox, OutboxError, Relay, RelayError};
            use idem_runtime::{Delivery, Route, Transient, idempotent};
            use idem_tests::outbox::{
                out_stream, pending_rows, spawn_relay, stop_relay, stored_ids,
            };
            use idem_tests::scenario::{
                Deposit, create_stream, eventually, fast, stop, wait_all_acked,
            };
            use idem_tests::unique_name;

            use super::{Tx, bed, ledger, record, spawn, store};

            /// Queues `count` deposits for `subject` in one committed
            /// transaction, with ids derived from `key`; their ids.
            async fn queue(
                pool: &store::Pool,
                key: &str,
                subject: &str,
                count: i64,
            ) -> Vec<String> {
                let outbox: Outbox = Outbox::keyed(key);
                let mut tx = pool.begin().await.expect("a transaction begins");
                let mut ids = Vec::new();
                for amount in 0..count {
                    let deposit = Deposit {
                        account: key.to_owned(),
                        amount,
                    };
                    ids.push(
                        outbox
                            .send(&mut tx, subject, &deposit)
                            .await
                            .expect("the row is queued"),
                    );
                }
                tx.commit().await.expect("the rows commit");
                ids
            }

            #[derive(Debug, thiserror::Error)]
            enum QueueError {
                #[error(transparent)]
                Outbox(#[from] OutboxError),
                #[error(transparent)]
                Database(#[from] sqlx::Error),
                #[error(transparent)]
                Refused(#[from] Transient),
            }

            impl idem_runtime::Classify for QueueError {
                fn class(&self) -> idem_runtime::ErrorClass {
                    match self {
                        QueueError::Outbox(error) => error.class(),
                        QueueError::Database(error) => idem_runtime::ErrorClass::of_sqlx(error),
                        QueueError::Refused(_) => idem_runtime::ErrorClass::RetryNow,
                    }
                }
            }

            /// Records the deposit and queues it for `<account>.credited`;
            /// an even amount's first delivery then fails, so that what it
            /// queued rolls back with its claim.
            #[idempotent(name = "queue-credit")]
            async fn queue_credit(
                tx: &mut Tx<'_>,
                delivery: &Delivery,
                outbox: Outbox,
                d: Deposit,
            ) -> Result<(), QueueError> {
                record(tx, "queue-credit", delivery, &d).await?;
                outbox
                    .send(tx, &format!("{}.credited", d.account), &d)
                    .await?;
                if delivery.delivered() == 1 && d.amount % 2 == 0 {
                    return Err(Transient::new("refused after queuing").into());
                }
                Ok(())
            }

            /// Every message's handler queues one message. Half fail once
            /// after queuing (their rows roll back); every first commit is
            /// dropped unacked, so the redeliveries find the claims and run
            /// nothing. Each router runs a relay. The stream gets exactly
            /// one message per input, none of them twice, and the outbox
            /// ends empty.
            #[tokio::test]
            async fn what_a_handler_queues_is_published_once_after_its_commit() {
                const MESSAGES: i64 = 20;
                let bed = bed("OBOX").await;
                let out = out_stream(&bed.js, "OBOXOUT").await;
                for i in 0..MESSAGES {
                    let id = format!("q-{i}");
                    idem_tests::scenario::publish(
                        &bed.js,
                        &bed.subject,
                        &idem_tests::scenario::deposit(&out, i),
                        Some(&id),
                    )
                    .await;
                }
                let route = || {
                    fast(Route::new(&bed.stream, "c"))
                        .per_message()
                        .ack_wait(Duration::from_secs(2))
                };
                let (relay_a, relay_b) = (Relay::new(), Relay::new());
                let (stats_a, stats_b) = (relay_a.stats(), relay_b.stats());
                let first = store::router_with_state(())
                    .route(route(), queue_credit)
                    .relay(relay_a)
                    .fault_hooks(
                        FaultHooks::default().after_commit(|_| AfterCommit::DropWithoutAck),
                    );
                let (handle, task) = spawn(first, &bed, &bed.pool);
                let first_stats = handle.stats("c").unwrap();
                eventually(
                    "every message committed and was dropped unacked",
                    Duration::from_secs(60),
                    || async { first_stats.dropped_by_fault() as i64 >= MESSAGES },
                )
                .await;
                assert!(
                    first_stats.failed() >= (MESSAGES / 2) as u64,
                    "the even messages failed after queuing: {}",
                    first_stats.failed()
                );
                stop(handle, task).await;

                let second = store::router_with_state(())
                    .route(route(), queue_credit)
                    .relay(relay_b);
                let (handle, task) = spawn(second, &bed, &bed.second_pool);
                wait_all_acked(&bed.js, &bed.stream, "c").await;
                eventually("the outbox is drained", Duration::from_secs(30), || async {
                    pending_rows(&bed.pool).await == 0
                })
                .await;
                stop(handle, task).await;

                assert_eq!(
                    ledger(&bed, "queue-credit").await,
                    (MESSAGES, MESSAGES),
                    "effects = inputs, no duplicates"
                );
                let ids = stored_ids(&bed.js, &out).await;
                let distinct: HashSet<&String> = ids.iter().collect();
                assert_eq!(
                    (ids.len(), distinct.len()),
                    (MESSAGES as usize, MESSAGES as usize),
                    "one message per input reached the stream, none twice"
                );
                assert_eq!(
                    (
                        stats_a.published() + stats_b.published(),
                        stats_a.duplicates() + stats_b.duplicates()
                    ),
                    (MESSAGES as u64, 0),
                    "the relays published each row once: no rolled-back row, no second take"
                );
            }

            /// A row for a subject no stream stores fails on its own: the
            /// rows beside it go out, it is reported (failing, with its
            /// subject and error) and backs off; once a stream stores its
            /// subject and it is retried, it goes out once.
            #[tokio::test]
            async fn a_row_that_cannot_be_published_fails_alone_and_goes_out_once_fixed() {
                let bed = bed("OBFAIL").await;
                let out = out_stream(&bed.js, "OBFAILOUT").await;
                let nowhere = unique_name("OBNOWHERE");
                let stuck = format!("{nowhere}.lost");
                let stuck_ids = queue(&bed.pool, "stuck", &stuck, 1).await;
                let ids = queue(&bed.pool, "fine", &format!("{out}.fine"), 5).await;

                let relay = Relay::new();
                let stats = relay.stats();
                let (stop, task) = spawn_relay(relay, bed.nats.clone(), bed.pool.clone());
                eventually(
                    "the good rows go out and the stuck one is failing",
                    Duration::from_secs(30),
                    || async {
                        let lag = outbox::lag(&bed.pool).await.expect("the lag reads");
                        stored_ids(&bed.js, &out).await.len() == ids.len()
                            && lag.pending == 1
                            && lag.failing == 1
                    },
                )
                .await;
                let lag = outbox::lag(&bed.pool).await.expect("the lag reads");
                let failing = &lag.failures[0];
                assert_eq!(
                    failing.subject, stuck,
                    "the failing row's subject is reported"
                );
                assert!(
                    failing.attempts >= 1 && !failing.error.is_empty(),
                    "{failing:?}"
                );
                // The relay counts a cycle's failure after the commit that
                // marked the row, so the count may lag the table a moment.
                eventually(
                    "the relay counts the failure",
                    Duration::from_secs(10),
                    async || stats.failed() >= 1,
                )
                .await;
                assert_eq!(
                    stored_ids(&bed.js, &out).await,
                    ids,
                    "the rows beside it went out, in order"
                );

                create_stream(
                    &bed.js,
                    &nowhere,
                    &format!("{nowhere}.>"),
                    Duration::from_secs(120),
                )
                .await;
                let due = outbox::retry_failing(&bed.pool, Some(&stuck))
                    .await
                    .expect("the retry is recorded");
                assert_eq!(due, 1, "the one failing row is made due");
                eventually(
                    "the fixed row goes out",
                    Duration::from_secs(30),
                    || async { pending_rows(&bed.pool).await == 0 },
                )
                .await;
                stop_relay(stop, task).await;
                assert_eq!(
                    stored_ids(&bed.js, &nowhere).await,
                    stuck_ids,
                    "published once"
                );
            }

            fn crash_once(
                crashes: Arc<AtomicUsize>,
            ) -> impl Fn(&[outbox::Published]) -> AfterPubAcks + Send + Sync + 'static {
                move |_| {
                    if crashes.fetch_add(1, Ordering::SeqCst) == 0 {
                        AfterPubAcks::Crash
                    } else {
                        AfterPubAcks::Delete
                    }
                }
            }

            /// A relay that dies after its PubAcks and before its DELETE
            /// deleted nothing, and leaves its rows to the next relay at
            /// once (its rollback releases them), which republishes each:
            /// JetStream drops the copies, and the stream holds one of each.
            #[tokio::test]
            async fn a_relay_that_dies_after_its_pubacks_leaves_its_rows_to_the_next() {
                let bed = bed("OBCRASH").await;
                let out = out_stream(&bed.js, "OBCRASHOUT").await;
                let ids = queue(&bed.pool, "crash", &format!("{out}.paid"), 5).await;

                let crashes = Arc::new(AtomicUsize::new(0));
                let dying = Relay::new().fault_after_pubacks(crash_once(crashes.clone()));
                let ended = dying
                    .run_until(bed.nats.clone(), bed.pool.clone(), std::future::pending())
                    .await;
                assert!(
                    matches!(ended, Err(RelayError::InjectedCrash(5))),
                    "the relay died after 5 PubAcks: {ended:?}"
                );
                assert_eq!(crashes.load(Ordering::SeqCst), 1);
                assert_eq!(
                    stored_ids(&bed.js, &out).await,
                    ids,
                    "published before the crash"
                );
                assert_eq!(
                    pending_rows(&bed.pool).await,
                    5,
                    "the dead relay deleted nothing"
                );

                let relay = Relay::new();
                let cycle = relay
                    .relay_batch(&bed.js, &bed.second_pool)
                    .await
                    .expect("a cycle runs");
                let republished: Vec<&str> =
                    cycle.published.iter().map(|p| p.msg_id.as_str()).collect();
                assert_eq!(
                    republished, ids,
                    "every row is republished at once, in order"
                );
                assert!(
                    cycle.published.iter().all(|p| p.duplicate),
                    "JetStream drops each copy: {:?}",
                    cycle.published
                );
                assert_eq!(pending_rows(&bed.pool).await, 0);
                assert_eq!(stored_ids(&bed.js, &out).await, ids, "one copy of each");
            }

            /// Two relays, each on its own pool, publish side by side
            /// (rounds of rows are queued until both have published): every
            /// row goes out once, and no publish comes back a duplicate, so
            /// neither took a row the other held.
            #[tokio::test]
            async fn two_relays_never_take_the_same_row() {
                let bed = bed("OBTWO").await;
                let out = out_stream(&bed.js, "OBTWOOUT").await;
                let (a, b) = (Relay::new().batch_size(8), Relay::new().batch_size(8));
                let (stats_a, stats_b) = (a.stats(), b.stats());
                let (stop_a, task_a) = spawn_relay(a, bed.nats.clone(), bed.pool.clone());
                let (stop_b, task_b) = spawn_relay(b, bed.nats.clone(), bed.second_pool.clone());
                eventually("both relays cycle", Duration::from_secs(30), || async {
                    stats_a.empty_cycles() > 0 && stats_b.empty_cycles() > 0
                })
                .await;
                let mut ids = HashSet::new();
                let mut rounds = 0;
                while rounds < 5
                    && (rounds == 0 || stats_a.published() == 0 || stats_b.published() == 0)
                {
                    for transaction in 0..20 {
                        let key = format!("two-{rounds}-{transaction}");
                        ids.extend(queue(&bed.pool, &key, &format!("{out}.paid"), 10).await);
                    }
                    rounds += 1;
                    eventually(
                        "the relays publish every row",
                        Duration::from_secs(60),
                        || async {
                            stored_ids(&bed.js, &out).await.len() >= ids.len()
                                && pending_rows(&bed.pool).await == 0
                        },
                    )
                    .await;
                }
                stop_relay(stop_a, task_a).await;
                stop_relay(stop_b, task_b).await;
                assert!(
                    stats_a.published() > 0 && stats_b.published() > 0,
                    "both relays published, in {rounds} round(s): {} and {}",
                    stats_a.published(),
                    stats_b.published()
                );
                assert_eq!(stats_a.published() + stats_b.published(), ids.len() as u64);
                assert_eq!(
                    stats_a.duplicates() + stats_b.duplicates(),
                    0,
                    "no row taken twice"
                );
                let stored: Vec<String> = stored_ids(&bed.js, &out).await;
                assert_eq!(
                    stored.len(),
                    ids.len(),
                    "no message reaches the stream twice"
                );
                assert_eq!(
                    stored.into_iter().collect::<HashSet<_>>(),
                    ids,
                    "none is missed"
                );
            }
        }
    };
}

pub(crate) use outbox_suite;
