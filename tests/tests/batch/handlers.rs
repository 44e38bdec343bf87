//! Batch handlers (`#[idempotent(batch)]`) take the fresh messages of a batch
//! in one call: each fresh message once, within and across batches; when one
//! fails, each message runs alone as a batch of one; on a per-message route
//! they get batches of one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Delivery, Permanent, Route, Router, State, idempotent};
use idem_tests::scenario::*;

// --- Batch handlers -----------------------------------------------------------

/// The accounts of each batch a batch handler was called with, in order.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<Vec<String>>>>);

impl Calls {
    fn all(&self) -> Vec<Vec<String>> {
        self.0.lock().unwrap().clone()
    }

    fn sizes(&self) -> Vec<usize> {
        self.all().iter().map(Vec::len).collect()
    }
}

/// Writes the fresh messages of a batch with one statement, then refuses
/// the whole batch if it holds the account "refused".
#[idempotent(name = "deposit-many", key = |d| d.account, batch)]
async fn deposit_many(
    tx: &mut sqlx::PgTransaction<'_>,
    State(calls): State<Calls>,
    deliveries: &[Delivery],
    deposits: Vec<Deposit>,
) -> Result<(), idem_runtime::BoxError> {
    let accounts: Vec<String> = deposits.iter().map(|d| d.account.clone()).collect();
    calls.0.lock().unwrap().push(accounts);
    assert_eq!(deliveries.len(), deposits.len(), "one delivery per message");
    let ids: Vec<&str> = deliveries.iter().map(|d| d.message_id().as_str()).collect();
    let delivered: Vec<i64> = deliveries.iter().map(|d| d.delivered() as i64).collect();
    let accounts: Vec<&str> = deposits.iter().map(|d| d.account.as_str()).collect();
    let amounts: Vec<i64> = deposits.iter().map(|d| d.amount).collect();
    sqlx::query(
        "INSERT INTO effects (handler, message_id, account, amount, delivered)
         SELECT 'deposit-many', * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[])",
    )
    .bind(&ids)
    .bind(&accounts)
    .bind(&amounts)
    .bind(&delivered)
    .execute(&mut **tx)
    .await?;
    if accounts.contains(&"refused") {
        return Err(Permanent::new("this batch holds an account that refuses deposits").into());
    }
    Ok(())
}

/// On a route left at its defaults, a batch handler's batches grow past
/// the cap a handler called once per message gets (64), up to
/// `DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER` (128; with concurrency 2, 128 fit
/// in the default max_ack_pending), and each message is applied once.
#[tokio::test]
async fn a_batch_handler_on_a_default_route_takes_batches_past_64() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BHDEFAULT", Duration::from_secs(120)).await;
    const MESSAGES: usize = 1_500;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: format!("acct-{i}"),
            amount: 1,
        };
        publish(&js, &subject, &deposit, Some(&format!("d-{i}"))).await;
    }
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone())
            .route(Route::new(&stream, "c").concurrency(2), deposit_many),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let sizes = calls.sizes();
    let largest = sizes.iter().copied().max().unwrap_or(0);
    assert!(
        largest > idem_runtime::route::DEFAULT_ADAPTIVE_MAX,
        "the batches grew past 64: {sizes:?}"
    );
    assert!(
        largest <= idem_runtime::route::DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER,
        "never past 128: {sizes:?}"
    );
    assert_eq!(sizes.iter().sum::<usize>(), MESSAGES, "each message once");
    assert_eq!(handle.stats("c").unwrap().batch_fallbacks(), 0);
    assert_eq!(
        ledger(&pool, "deposit-many").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

/// A batch handler is called once per batch with only its fresh messages:
/// a key seen earlier in the same batch, in another batch, or in a later
/// copy of the stream never reaches it, and each key is written once.
#[tokio::test]
async fn a_batch_handler_gets_each_fresh_message_once_within_and_across_batches() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BHDUP", Duration::from_secs(120)).await;
    const MESSAGES: usize = 100;
    const ACCOUNTS: usize = 30;
    let deposit = |i: usize| Deposit {
        account: format!("acct-{}", i % ACCOUNTS),
        amount: 1,
    };
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit(i), Some(&format!("m-{i}"))).await;
    }
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone()).route(
            Route::new(&stream, "c").batch(32).concurrency(2),
            deposit_many,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    let first_round = calls.sizes();
    // Every key again, after all were processed: all duplicates.
    for i in 0..ACCOUNTS {
        publish(&js, &subject, &deposit(i), Some(&format!("again-{i}"))).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(
        first_round.iter().sum::<usize>(),
        ACCOUNTS,
        "each key reached the handler once: {first_round:?}"
    );
    assert!(
        first_round.iter().any(|&size| size > 1),
        "the handler took several messages in one call: {first_round:?}"
    );
    assert_eq!(
        calls.sizes(),
        first_round,
        "no later copy reached the handler"
    );
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.processed(), stats.duplicates()),
        (ACCOUNTS as u64, (MESSAGES - ACCOUNTS + ACCOUNTS) as u64)
    );
    assert_eq!(stats.batch_fallbacks(), 0);
    assert_eq!(
        ledger(&pool, "deposit-many").await,
        Ledger::once_each(ACCOUNTS as i64)
    );
}

/// A batch handler that fails rolls its whole batch back; the batch is then
/// tried again in halves, down to the bad message alone (a call of one): it
/// is dead-lettered, and its neighbours are each applied once.
#[tokio::test]
async fn a_failing_batch_handler_is_tried_again_in_halves_down_to_the_bad_message() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BHFALL", Duration::from_secs(120)).await;
    const MESSAGES: i64 = 40;
    for i in 0..MESSAGES {
        let account = if i == 17 {
            "refused".to_owned()
        } else {
            format!("acct-{i}")
        };
        let deposit = Deposit { account, amount: i };
        publish(&js, &subject, &deposit, Some(&format!("f-{i}"))).await;
    }
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone()).route(
            Route::new(&stream, "c").batch(16).concurrency(2),
            deposit_many,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(
        stats.batch_fallbacks(),
        1,
        "only the batch with the bad message fell back"
    );
    assert_eq!((stats.processed(), stats.dead_lettered()), (39, 1));
    let all = calls.all();
    let failed = all
        .iter()
        .position(|accounts| accounts.len() > 1 && accounts.iter().any(|a| a == "refused"))
        .expect("the bad message came in a batch of several");
    let failed_batch = &all[failed];
    // Its later calls: those of the halves it was split into (calls of
    // other batches in flight beside it have other messages).
    let halves: Vec<&Vec<String>> = all[failed + 1..]
        .iter()
        .filter(|accounts| accounts.iter().all(|a| failed_batch.contains(a)))
        .collect();
    assert!(
        halves
            .iter()
            .any(|accounts| accounts == &&vec!["refused".to_owned()]),
        "the bad message was split off until it ran alone: {all:?}"
    );
    assert!(
        halves
            .iter()
            .any(|accounts| accounts.len() > 1 && accounts.len() < failed_batch.len()),
        "its neighbours were tried again together, in halves, not one per call: {all:?}"
    );
    assert_eq!(ledger(&pool, "deposit-many").await, Ledger::once_each(39));
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE account = 'refused'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refused, 0, "the failing message's write was rolled back");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "refused");
}

/// On a per-message route, a batch handler runs each message as a batch
/// of one.
#[tokio::test]
async fn a_batch_handler_on_a_per_message_route_gets_batches_of_one() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BHONE", Duration::from_secs(120)).await;
    for i in 0..10 {
        let deposit = Deposit {
            account: format!("acct-{}", i % 5),
            amount: 1,
        };
        publish(&js, &subject, &deposit, Some(&format!("o-{i}"))).await;
    }
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone())
            .route(Route::new(&stream, "c").per_message(), deposit_many),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(calls.sizes(), vec![1; 5]);
    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (5, 5));
    assert_eq!(ledger(&pool, "deposit-many").await, Ledger::once_each(5));
}
