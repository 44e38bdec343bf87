//! The purge's blind spots: which retention it applies, when it drops a
//! generation, and batch claims meeting a rotation.
//!
//! - Generations are shared by every handler, so the purge must apply the
//!   longest retention, and a generation may go only a full retention after
//!   it was sealed: a claim made just before a rotation (its generation is
//!   sealed just after it) must be a duplicate until the edge of the longest
//!   retention. Each of "the shortest retention", "as soon as sealed" and
//!   "one generation early" fails this test.
//! - Batch claims (`idem_claim_many`, in both batch modes) with every
//!   message stored twice, the copies straddling rotations: none applied
//!   twice, and the test checks that the copies did straddle them.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_runtime::expiry;
use idem_runtime::{Delivery, Route, Router, Unbounded, idempotent};
use idem_tests::claims::*;
use idem_tests::scenario::*;
use sqlx::PgPool;

/// When the claim of `key` was made, in Unix seconds by the database's
/// clock.
async fn claimed_at(pool: &PgPool, key: &str) -> f64 {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM min(claimed_at))::float8 FROM idem_claims WHERE key = $1::uuid",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// How long ago `epoch` was, by the database's clock.
async fn since(pool: &PgPool, epoch: f64) -> Duration {
    let age: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8 - $1")
        .bind(epoch)
        .fetch_one(pool)
        .await
        .unwrap();
    Duration::from_secs_f64(age.max(0.0))
}

/// Two handlers with retentions of 2 s and 6 s, and one without: the
/// purge keeps every claim at least 6 s. Claims of both are made just
/// before a rotation, so that their generation is sealed right after them;
/// each is tried again every 100 ms beside the purge: a duplicate until
/// 300 ms short of 6 s, gone within a generation and a second after it.
/// The kept claim outlives them.
#[tokio::test]
async fn the_longest_retention_holds_a_claim_made_just_before_a_rotation_to_its_edge() {
    const SHORT: Duration = Duration::from_secs(2);
    const LONG: Duration = Duration::from_secs(6);
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let short = register(&pool, "short", SHORT).await;
    let long = register(&pool, "long", LONG).await;
    let kept = register_forever(&pool, "kept").await;
    let (short_key, long_key, kept_key) = (key(1), key(2), key(3));
    assert!(claim_once(&pool, short, &short_key).await);
    assert!(claim_once(&pool, long, &long_key).await);
    assert!(claim_once(&pool, kept, &kept_key).await);
    // At once: the claims are the last of generation 1, which is sealed
    // within moments of them.
    assert_eq!(rotate_and_seal(&pool).await, 2);
    let sealed_after: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM g.sealed_at - c.claimed_at)::float8
           FROM idem_generations g, idem_claims c WHERE g.gen = 1 AND c.key = $1::uuid",
    )
    .bind(&long_key)
    .fetch_optional(&pool)
    .await
    .unwrap();
    let sealed_after =
        sealed_after.expect("generation 1 is sealed, not expired, and holds the claim");
    assert!(
        sealed_after < 1.0,
        "sealed {sealed_after} s after the claim"
    );

    let claimed = claimed_at(&pool, &long_key).await;
    let deadline = Instant::now() + 3 * LONG;
    let gone_at = loop {
        assert!(Instant::now() < deadline, "the claim never expired");
        expiry::purge(&pool).await.unwrap();
        let age = since(&pool, claimed).await;
        if age < LONG - Duration::from_millis(300) {
            assert!(
                !claim_once(&pool, long, &long_key).await,
                "a copy {age:?} after the claim, inside the longest retention, is a duplicate"
            );
            assert!(
                !claim_once(&pool, short, &short_key).await,
                "a claim of the shorter retention lives as long: {age:?}"
            );
        } else if claim_once(&pool, long, &long_key).await {
            break age;
        }
        assert!(!claim_once(&pool, kept, &kept_key).await, "kept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("the claim went {gone_at:?} after it was made");
    assert!(gone_at >= LONG, "not before the retention: {gone_at:?}");
    let generation = expiry::generation_length(LONG);
    assert!(
        gone_at <= LONG + generation + Duration::from_secs(1),
        "within a generation of it: {gone_at:?}"
    );
    assert!(!claim_once(&pool, kept, &kept_key).await, "kept forever");
}

#[idempotent(name = "batched-each")]
async fn batched_each(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "batched-each", &d, delivery).await
}

#[idempotent(name = "batched-whole", batch)]
async fn batched_whole(
    tx: &mut sqlx::PgTransaction<'_>,
    deliveries: &[Delivery],
    deposits: Vec<Deposit>,
) -> Result<(), sqlx::Error> {
    for (delivery, deposit) in deliveries.iter().zip(&deposits) {
        record_effect(tx, "batched-whole", deposit, delivery).await?;
    }
    Ok(())
}

/// A batch route whose retention floor (about 43 s with copies up to 2 s
/// after their message: a 1 s handler timeout for each of up to 4 calls,
/// ack_wait 1 s, max_deliver 3, NAK delays of 100 and 200 ms) is below its
/// retention of a minute; the stream keeps messages forever and the test
/// replays none, so it accepts that term. The test rotates the claims
/// table every second itself, far more often than that retention would.
fn batch_route(stream: &str) -> Route {
    Route::new(stream, "c")
        .batch(4)
        .concurrency(2)
        .ack_wait(Duration::from_secs(1))
        .handler_timeout(Duration::from_secs(1))
        .max_deliver(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(200))
        .publisher_retry_horizon(COPY_LAG)
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
        .retention(BATCH_RETENTION)
}

const BATCH_RETENTION: Duration = Duration::from_secs(60);
/// How long after its message each copy is published.
const COPY_LAG: Duration = Duration::from_secs(2);
/// Messages are published in bursts of this many, so that batches form.
const BURST: i64 = 4;
/// Between two bursts.
const PACE: Duration = Duration::from_millis(160);
const MESSAGES: i64 = 300;
/// A rotation is made due, and the purge run, after this many bursts
/// (about every second).
const ROTATE_EVERY: i64 = 6;

/// How the copies met the generations.
#[derive(Debug, Default)]
struct Straddles {
    /// Copies published after a rotation that came after their message's
    /// claim.
    rotated: usize,
    /// Of those, copies whose message's claim was in sealed generations
    /// only: its copy's claim found it by the probe.
    sealed: usize,
    /// Rotations during the run.
    rotations: i32,
}

/// Publishes every message twice, the copy `COPY_LAG` later (after the
/// stream's duplicate window), in bursts, while `handler`'s router runs
/// with its own purge, and rotates the claims table about every second;
/// checks at each copy whether a rotation came between the message's claim
/// and the copy.
async fn publish_twice_across_rotations(
    js: &jetstream::Context,
    pool: &PgPool,
    subject: &str,
    handler: &str,
) -> Straddles {
    let mut straddles = Straddles::default();
    let behind = (COPY_LAG.as_millis() / PACE.as_millis()) as i64;
    let bursts = MESSAGES / BURST;
    for step in 0..bursts + behind {
        for n in 0..BURST {
            let i = step * BURST + n;
            if step < bursts {
                let deposit = Deposit {
                    account: "a".into(),
                    amount: i,
                };
                publish(js, subject, &deposit, Some(&format!("m-{i}"))).await;
            }
            let original = i - behind * BURST;
            if original < 0 {
                continue;
            }
            let id = format!("m-{original}");
            let (generations, current, transition): (Option<Vec<i32>>, i32, bool) = sqlx::query_as(
                "SELECT (SELECT array_agg(gen) FROM idem_claims WHERE key = idem_key($1, $2)),
                            current_gen, transition
                       FROM idem_dedup_state",
            )
            .bind(handler)
            .bind(&id)
            .fetch_one(pool)
            .await
            .unwrap();
            if let Some(newest) = generations.and_then(|g| g.into_iter().max()) {
                if current > newest {
                    straddles.rotated += 1;
                }
                if newest < current - i32::from(transition) {
                    straddles.sealed += 1;
                }
            }
            let copy = Deposit {
                account: "a".into(),
                amount: original,
            };
            publish(js, subject, &copy, Some(&id)).await;
        }
        if step % ROTATE_EVERY == 0 {
            // The router's purge runs too; whichever holds the purge lock
            // rotates.
            sqlx::query(
                "UPDATE idem_generations SET opened_at = now() - interval '1 hour'
                  WHERE gen = (SELECT current_gen FROM idem_dedup_state)",
            )
            .execute(pool)
            .await
            .unwrap();
            expiry::purge(pool).await.unwrap();
        }
        tokio::time::sleep(PACE).await;
    }
    straddles.rotations = state(pool).await.0 - 1;
    straddles
}

/// Runs `router` on a fresh stream while every message is published twice
/// across rotations; checks that none was applied twice.
async fn batch_claims_meet_rotations(
    prefix: &str,
    handler: &str,
    router: impl FnOnce(&str) -> Router,
) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario(prefix, Duration::from_millis(100)).await;
    let stream_config = js
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    let floor = batch_route(&stream).retention_floor(&stream_config);
    assert!(
        floor.value().is_some_and(|floor| floor <= BATCH_RETENTION),
        "{floor}"
    );
    let (handle, task) = spawn(router(&stream), nats, pool.clone());
    let straddles = publish_twice_across_rotations(&js, &pool, &subject, handler).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    println!("{straddles:?}; {stats:?}");
    assert!(
        stats.batches() >= 1 && stats.largest_batch() > 1,
        "batches of several messages committed"
    );
    assert!(
        straddles.rotations >= 5 && straddles.rotated >= 100 && straddles.sealed >= 50,
        "copies straddled rotations, and sealed generations: {straddles:?}"
    );
    assert_eq!(
        stats.duplicates(),
        MESSAGES as u64,
        "every copy was skipped"
    );
    let ledger = ledger(&pool, handler).await;
    assert_eq!(
        (ledger.effects, ledger.distinct_messages),
        (MESSAGES, MESSAGES),
        "no message applied twice"
    );
}

/// A per-message handler on a batch route, claimed by `idem_claim_many`.
#[tokio::test]
async fn batch_claims_across_rotations_apply_each_message_once() {
    batch_claims_meet_rotations("BATCHROT", "batched-each", |stream| {
        Router::new().route(batch_route(stream), batched_each)
    })
    .await;
}

/// A batch handler (`#[idempotent(batch)]`), claimed the same way.
#[tokio::test]
async fn batch_handler_claims_across_rotations_apply_each_message_once() {
    batch_claims_meet_rotations("BATCHWHOLE", "batched-whole", |stream| {
        Router::new().route(batch_route(stream), batched_whole)
    })
    .await;
}
