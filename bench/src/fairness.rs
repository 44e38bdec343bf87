//! Two routes on a small pool (issue 20, "fair connection hand-off"): both
//! at `concurrency` messages in flight on a pool of fewer connections than
//! their sum, each offered `rate` messages per second, with a handler that
//! holds its transaction for `hold`. The end-to-end latency (publish → ack)
//! of each route's messages shows whether a waiting message gets the next
//! connection, or waits while the other route keeps its own for its next
//! messages.

use std::time::{Duration, Instant};

use async_nats::jetstream::stream;
use idem_runtime::{Route, Router, State, idempotent};
use serde_json::json;
use sqlx::AssertSqlSafe;

use crate::consumers::Payload;
use crate::probe::{self, AckObserver};
use crate::run::{self, Context, Database, Plan, percentile_ms};
use crate::{BenchError, report};

/// What `fairness` runs.
#[derive(Debug, Clone)]
pub struct Fairness {
    /// Messages per route.
    pub messages: usize,
    /// Offered load per route, messages per second.
    pub rate: f64,
    /// The pool's connections.
    pub pool: u32,
    /// Messages in flight per route.
    pub concurrency: usize,
    /// How long the handler holds its transaction open.
    pub hold: Duration,
}

/// The handler's state: how long it holds its transaction.
#[derive(Debug, Clone, Copy)]
struct Hold(Duration);

/// Records the effect, then holds the transaction (and so its connection)
/// for the configured time, as a handler with some work in it does.
async fn record_and_hold(
    tx: &mut sqlx::PgTransaction<'_>,
    hold: Duration,
    msg: Payload,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO bench_effects (message_key, published_us) VALUES ($1, $2)")
        .bind(&msg.key)
        .bind(msg.published_us)
        .execute(&mut **tx)
        .await?;
    tokio::time::sleep(hold).await;
    Ok(())
}

/// Route a's handler (two routes may not share a handler: they would
/// share its claims).
#[idempotent(name = "bench.fairness.a.v1", key = msg.key)]
async fn held_a(
    tx: &mut sqlx::PgTransaction<'_>,
    State(Hold(hold)): State<Hold>,
    msg: Payload,
) -> Result<(), sqlx::Error> {
    record_and_hold(tx, hold, msg).await
}

/// Route b's handler.
#[idempotent(name = "bench.fairness.b.v1", key = msg.key)]
async fn held_b(
    tx: &mut sqlx::PgTransaction<'_>,
    State(Hold(hold)): State<Hold>,
    msg: Payload,
) -> Result<(), sqlx::Error> {
    record_and_hold(tx, hold, msg).await
}

/// One route's figures.
struct RouteFigures {
    messages: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// Runs the scenario once and prints each route's latency, and both
/// together.
pub async fn fairness(ctx: &Context, base: &Plan, f: &Fairness) -> Result<(), BenchError> {
    // The database's pool has `pool` connections (`Database::create` sizes
    // it by the plan's concurrency).
    let plan = Plan {
        scenario: "fairness",
        concurrency: f.pool as usize,
        messages: f.messages,
        ..base.clone()
    };
    let tag = ctx.next_tag();
    let db = Database::create(ctx, &tag, &plan).await?;
    let names: Vec<(String, String)> = ["a", "b"]
        .iter()
        .map(|route| {
            (
                format!("BENCH_{tag}_{route}"),
                format!("bench.{tag}.{route}"),
            )
        })
        .collect();
    let mut created = Vec::new();
    let mut outcome = Ok(());
    for (name, subject) in &names {
        let made = ctx
            .publisher
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await;
        match made {
            Ok(_) => created.push(name.clone()),
            Err(e) => {
                outcome = Err(BenchError::failed(format!("create stream {name}: {e}")));
                break;
            }
        }
    }
    let measured = match outcome {
        Ok(()) => measure(ctx, &db, &names, f).await,
        Err(e) => Err(e),
    };
    for name in created {
        if let Err(e) = ctx.publisher.delete_stream(&name).await {
            tracing::warn!(%e, stream = name, "cannot delete the bench stream");
        }
    }
    db.drop().await;
    let (routes, all, elapsed) = measured?;
    eprintln!(
        "\nfairness: two routes at {} in flight on a pool of {}, {:.0} msgs/s offered to each, \
         the handler holding its transaction {:?}; {} messages per route in {:.1} s:",
        f.concurrency,
        f.pool,
        f.rate,
        f.hold,
        f.messages,
        elapsed.as_secs_f64()
    );
    for (name, figures) in [
        ("route a", &routes[0]),
        ("route b", &routes[1]),
        ("both", &all),
    ] {
        eprintln!(
            "  {name:<8} e2e p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>9.2} ms ({} msgs)",
            figures.p50_ms, figures.p99_ms, figures.max_ms, figures.messages
        );
    }
    let (slower, faster) = if routes[0].p99_ms >= routes[1].p99_ms {
        (&routes[0], &routes[1])
    } else {
        (&routes[1], &routes[0])
    };
    let split = slower.p99_ms / faster.p99_ms;
    eprintln!("targets:");
    eprintln!(
        "{}",
        report::target(
            "p99, slower route / faster <= 1.5x",
            Some(split),
            "x",
            |v| v <= 1.5
        )
    );
    eprintln!(
        "{}",
        report::target(
            "longest e2e <= 1 s (no message starved)",
            Some(all.max_ms / 1000.0),
            " s",
            |v| v <= 1.0
        )
    );
    let as_json = |figures: &RouteFigures| {
        json!({
            "messages": figures.messages,
            "p50_ms": round(figures.p50_ms),
            "p99_ms": round(figures.p99_ms),
            "max_ms": round(figures.max_ms),
        })
    };
    println!(
        "{}",
        json!({
            "mode": "fairness",
            "pool": f.pool,
            "concurrency": f.concurrency,
            "rate_per_route": f.rate,
            "hold_ms": f.hold.as_secs_f64() * 1000.0,
            "messages_per_route": f.messages,
            "elapsed_s": round(elapsed.as_secs_f64()),
            "route_a": as_json(&routes[0]),
            "route_b": as_json(&routes[1]),
            "both": as_json(&all),
            "p99_split": round(split),
        })
    );
    Ok(())
}

/// Publishes to both streams at the rate while the router consumes, and
/// returns each route's latencies, both together, and how long it took.
async fn measure(
    ctx: &Context,
    db: &Database,
    names: &[(String, String)],
    f: &Fairness,
) -> Result<([RouteFigures; 2], RouteFigures, Duration), BenchError> {
    let mut observers = Vec::new();
    for (name, _) in names {
        observers.push(AckObserver::start(&ctx.observer, name, f.messages).await?);
    }
    let route = |i: usize| {
        let (name, subject) = &names[i];
        Route::new(name, format!("bench-fair-{i}"))
            .filter_subject(subject)
            .ack_wait(Duration::from_secs(30))
            .concurrency(f.concurrency)
            .max_ack_pending(1000)
            .per_message()
    };
    let router = Router::with_state(Hold(f.hold))
        .route(route(0), held_a)
        .route(route(1), held_b);
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(
        ctx.consumer.clone(),
        db.pool.clone(),
        std::future::pending::<()>(),
    ));
    let started = Instant::now();
    let keys = [run::message_keys(f.messages), run::message_keys(f.messages)];
    let (a, b) = tokio::join!(
        probe::publish(&ctx.publisher, &names[0].1, &keys[0], Some(f.rate), false),
        probe::publish(&ctx.publisher, &names[1].1, &keys[1], Some(f.rate), false),
    );
    let published = [a?, b?];
    let mut waited = Ok(());
    for observer in &observers {
        waited = observer
            .wait_for(
                f.messages,
                || {
                    task.is_finished()
                        .then(|| "the router stopped by itself".to_owned())
                },
                || {
                    (0..2)
                        .map(|i| {
                            handle
                                .stats(&format!("bench-fair-{i}"))
                                .map_or(0, |s| s.processed())
                                .to_string()
                        })
                        .collect::<Vec<_>>()
                        .join(" and ")
                        + " processed"
                },
            )
            .await;
        if waited.is_err() {
            break;
        }
    }
    if let Err(e) = waited {
        handle.shutdown();
        let ended = task.await;
        return Err(BenchError::failed(format!(
            "{e}; the router returned {ended:?}"
        )));
    }
    let elapsed = started.elapsed();
    handle.shutdown();
    task.await
        .map_err(|e| BenchError::failed(format!("router task: {e}")))?
        .map_err(|e| BenchError::failed(format!("router: {e}")))?;
    let mut all = Vec::new();
    let mut routes = Vec::new();
    for (observer, published) in observers.into_iter().zip(&published) {
        let acks = observer.finish().await?;
        let mut latencies: Vec<Duration> = published
            .messages
            .iter()
            .filter_map(|p| Some(acks.get(p.seq)?.saturating_duration_since(p.at)))
            .collect();
        latencies.sort_unstable();
        all.extend_from_slice(&latencies);
        routes.push(figures(&latencies));
    }
    all.sort_unstable();
    check(db, 2 * f.messages).await?;
    let routes: [RouteFigures; 2] = routes
        .try_into()
        .map_err(|_| BenchError::failed("two routes measured".to_owned()))?;
    Ok((routes, figures(&all), elapsed))
}

fn figures(sorted: &[Duration]) -> RouteFigures {
    RouteFigures {
        messages: sorted.len(),
        p50_ms: percentile_ms(sorted, 0.50),
        p99_ms: percentile_ms(sorted, 0.99),
        max_ms: percentile_ms(sorted, 1.0),
    }
}

/// Effects = inputs, no duplicate effect, one claim each.
async fn check(db: &Database, expected: usize) -> Result<(), BenchError> {
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_key) FROM bench_effects")
            .fetch_one(&db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("count effects: {e}")))?;
    let claims: i64 = sqlx::query_scalar(AssertSqlSafe(
        "SELECT count(*) FROM idem_processed WHERE handler LIKE 'bench.fairness.%'".to_owned(),
    ))
    .fetch_one(&db.pool)
    .await
    .map_err(|e| BenchError::failed(format!("count claims: {e}")))?;
    if (rows, distinct, claims) != (expected as i64, expected as i64, expected as i64) {
        return Err(BenchError::failed(format!(
            "fairness: {rows} effects of {distinct} distinct messages and {claims} claims, \
             expected {expected} of each: FAILED effects = inputs"
        )));
    }
    Ok(())
}

fn round(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}
