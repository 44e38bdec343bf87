//! The retention scenarios (issue 10's targets): per-message idem against a
//! dedup table of 100 million claims with the purge running (`steady`), the
//! purge expiring a generation of 10 million (`purge`), and the bytes a
//! claim takes against the version-1 table (`storage`).
//!
//! Each compares with a baseline measured in the same run, on the same
//! servers: the machine is shared, and only ratios travel.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_runtime::retention::expiry;
use idem_runtime::schema;
use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool};

use crate::consumers::Mode;
use crate::fixture::{self, Layout};
use crate::report;
use crate::run::{self, Context, Database, Measurement, Plan};
use crate::stalls;
use crate::{BenchError, run_and_print};

/// How often the steady state runs `expiry::purge` beside the router's
/// own (which, at a day's retention, runs every minute): as a cron job
/// might, so that every run sees the purge's passes, an expiry, a rotation
/// and the end of its transition.
const PURGE_EVERY: Duration = Duration::from_secs(1);

/// What `steady` runs.
#[derive(Debug, Clone)]
pub struct Steady {
    /// Claims in the full table's live generations.
    pub rows: u64,
    /// Live generations (the current one and the sealed ones).
    pub live: u32,
    /// The backlog of the throughput runs.
    pub messages: usize,
    /// Messages of the latency runs, published at `rate`.
    pub latency_messages: usize,
    pub rate: f64,
    /// When, after the consumer starts, the current generation is due to
    /// rotate.
    pub rotate_after: Duration,
}

/// The full table's expiring generations, each this share of its claims:
/// one expires in each of the two runs.
const EXPIRING_SHARE: u64 = 20;

/// Steady state: idem with retention on and the purge running, against an
/// empty dedup table and one of `rows` claims, in one run. For each table:
/// a throughput run (a backlog), then a latency run (a fixed offered
/// rate), with `expiry::purge` running every second beside the router's
/// own. Before each, the current generation is made due to rotate
/// `rotate_after` into the run, and one expiring generation is made due:
/// the purge expires it at its first pass, rotates during the run, and
/// ends the rotation's transition a pass later.
pub async fn steady(
    ctx: &Context,
    base: &Plan,
    s: &Steady,
) -> Result<Vec<Measurement>, BenchError> {
    let layouts: [(&'static str, Layout); 2] =
        [("empty", 0), ("full", s.rows)].map(|(label, rows)| {
            (
                label,
                Layout {
                    rows,
                    live: s.live,
                    expiring: vec![rows / EXPIRING_SHARE; 2],
                    pieces: None,
                },
            )
        });
    let mut dbs = Vec::new();
    for (label, layout) in &layouts {
        let db = fill(ctx, base, "steady", label, layout).await;
        match db {
            Ok(db) => dbs.push((*label, db)),
            Err(e) => {
                for (_, db) in dbs {
                    db.drop().await;
                }
                return Err(e);
            }
        }
    }
    let outcome = steady_runs(ctx, base, s, &dbs).await;
    for (_, db) in dbs {
        db.drop().await;
    }
    let (throughput, latency) = outcome?;
    let ratio = |runs: &[Measurement], value: fn(&Measurement) -> Option<f64>| {
        Some(value(&runs[1])? / value(&runs[0])?)
    };
    let tput = ratio(&throughput, |m| Some(m.msgs_per_sec));
    let e2e = ratio(&latency, |m| Some(m.p99_ms));
    let claim = ratio(&latency, |m| m.claim_p99_ms);
    let claim_saturated = ratio(&throughput, |m| m.claim_p99_ms);
    eprintln!("\nsteady state, {} claims vs empty, purge running:", s.rows);
    for (label, runs) in [("throughput", &throughput), ("latency", &latency)] {
        for m in runs.iter() {
            eprintln!(
                "  {label:<10} {:<5} {:>7.0} msgs/s  e2e p50 {:>6.2} ms p99 {:>6.2} ms  \
                 claim p50 {:>6.2} ms p99 {:>6.2} ms",
                if m.plan.prefill == 0 { "empty" } else { "full" },
                m.msgs_per_sec,
                m.p50_ms,
                m.p99_ms,
                m.claim_p50_ms.unwrap_or(f64::NAN),
                m.claim_p99_ms.unwrap_or(f64::NAN),
            );
        }
    }
    eprintln!("targets:");
    eprintln!(
        "{}",
        report::target("idem throughput, full / empty >= 0.9x", tput, "x", |v| v
            >= 0.9)
    );
    eprintln!(
        "{}",
        report::target(
            "e2e p99 at a fixed rate, full / empty <= 2x",
            e2e,
            "x",
            |v| v <= 2.0
        )
    );
    eprintln!(
        "{}",
        report::target(
            "claim p99 at a fixed rate, full / empty <= 2x",
            claim,
            "x",
            |v| v <= 2.0
        )
    );
    println!(
        "{}",
        json!({
            "mode": "steady",
            "rows": s.rows,
            "live_generations": s.live,
            "throughput_ratio": tput.map(|v| round(v, 3)),
            "e2e_p99_ratio": e2e.map(|v| round(v, 3)),
            "claim_p99_ratio": claim.map(|v| round(v, 3)),
            "claim_p99_ratio_saturated": claim_saturated.map(|v| round(v, 3)),
        })
    );
    let mut runs = throughput;
    runs.extend(latency);
    Ok(runs)
}

/// The four runs: throughput on each table, then latency on each.
async fn steady_runs(
    ctx: &Context,
    base: &Plan,
    s: &Steady,
    dbs: &[(&'static str, Database)],
) -> Result<(Vec<Measurement>, Vec<Measurement>), BenchError> {
    let mut throughput = Vec::new();
    let mut latency = Vec::new();
    for (run, rate) in [(0, None), (1, Some(s.rate))] {
        for (label, db) in dbs {
            let expiring = run + 1;
            let rows = if *label == "empty" { 0 } else { s.rows };
            let plan = Plan {
                scenario: if rate.is_some() {
                    "steady-latency"
                } else {
                    "steady-throughput"
                },
                messages: if rate.is_some() {
                    s.latency_messages
                } else {
                    s.messages
                },
                rate,
                prefill: rows,
                retention: Some(fixture::FILL_RETENTION),
                before_consume: Some(format!(
                    "{} {}",
                    fixture::arm_rotation(s.rotate_after),
                    fixture::arm_expiry(expiring)
                )),
                time_in_tx: true,
                ..base.clone()
            };
            let before = fixture::generations(&db.pool).await.map_err(sql_failed)?;
            let measured =
                with_purge_every(&db.pool, PURGE_EVERY, run_and_print(ctx, plan, Some(db))).await?;
            let after = fixture::generations(&db.pool).await.map_err(sql_failed)?;
            eprintln!(
                "idem-bench: [{} {label}] the purge during the run: generations {:?} (current {}) \
                 -> {:?} (current {}{}): {}",
                measured.plan.scenario,
                before.2,
                before.0,
                after.2,
                after.0,
                if after.1 { ", in transition" } else { "" },
                purge_activity(&before, &after, expiring)
            );
            if rate.is_some() {
                latency.push(measured);
            } else {
                throughput.push(measured);
            }
        }
    }
    Ok((throughput, latency))
}

/// Runs `work` while `expiry::purge` runs every `interval` on `pool`.
async fn with_purge_every<T>(
    pool: &PgPool,
    interval: Duration,
    work: impl std::future::Future<Output = Result<T, BenchError>>,
) -> Result<T, BenchError> {
    let purging = async {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match expiry::purge(pool).await {
                Ok(report) => tracing::debug!(?report, "the bench's purge ran"),
                Err(e) => tracing::warn!(%e, "the bench's purge failed; again at its next run"),
            }
        }
    };
    tokio::select! {
        done = work => done,
        () = purging => unreachable!("the purge loop never ends"),
    }
}

/// What the purge did between two looks at the generations.
fn purge_activity(
    before: &(i32, bool, Vec<i32>),
    after: &(i32, bool, Vec<i32>),
    armed: i32,
) -> String {
    let expired = before.2.contains(&armed) && !after.2.contains(&armed);
    let rotated = after.0 > before.0;
    format!(
        "{}, {}",
        if expired {
            format!("expired generation {armed}")
        } else {
            format!("generation {armed} NOT expired yet")
        },
        if rotated {
            format!("rotated to {}", after.0)
        } else {
            "no rotation yet".to_owned()
        }
    )
}

/// A database of its own with the runtime's schema, filled with `layout`.
async fn fill(
    ctx: &Context,
    base: &Plan,
    scenario: &'static str,
    label: &str,
    layout: &Layout,
) -> Result<Database, BenchError> {
    let plan = Plan {
        scenario,
        prefill: 0,
        time_in_tx: true,
        ..base.clone()
    };
    let db = Database::create(ctx, &ctx.next_tag(), &plan).await?;
    let say = |what: &str| {
        eprintln!(
            "idem-bench: {:>7.2}s [{scenario} {label}] {what}",
            crate::since_start().as_secs_f64()
        )
    };
    let loaded = match fixture::load(&db.pool, layout, &say).await {
        Ok(loaded) => loaded,
        Err(e) => {
            db.drop().await;
            return Err(e);
        }
    };
    let checkpoint = Instant::now();
    // The load's dirty pages are flushed now, not during the runs.
    if let Err(e) = sqlx::query("CHECKPOINT").execute(&db.pool).await {
        tracing::info!(%e, "CHECKPOINT after the load skipped");
    }
    say(&format!(
        "{} claims in {} generations loaded in {:.1} s ({:.0} claims/s; checkpoint {:.1} s): \
         heap {:.2} GiB, indexes {:.2} GiB, {:.1} bytes per claim",
        loaded.rows,
        loaded.generations,
        loaded.elapsed.as_secs_f64(),
        loaded.rows as f64 / loaded.elapsed.as_secs_f64(),
        checkpoint.elapsed().as_secs_f64(),
        gib(loaded.table_bytes),
        gib(loaded.index_bytes),
        per_claim(loaded.table_bytes + loaded.index_bytes, loaded.rows)
    ));
    println!(
        "{}",
        json!({
            "mode": "fill",
            "scenario": scenario,
            "table": label,
            "rows": loaded.rows,
            "generations": loaded.generations,
            "load_s": round(loaded.elapsed.as_secs_f64(), 1),
            "checkpoint_s": round(checkpoint.elapsed().as_secs_f64(), 1),
            "heap_bytes": loaded.table_bytes,
            "index_bytes": loaded.index_bytes,
        })
    );
    Ok(db)
}

/// What `purge` runs.
#[derive(Debug, Clone)]
pub struct Purge {
    /// Claims in the generation expired.
    pub rows: u64,
    /// Messages published at `rate` while the purge runs a third of the
    /// way in.
    pub messages: usize,
    pub rate: f64,
    /// Where the servers keep their files, for the disk probe (`None`: the
    /// servers are not the bench's, and the disk is not probed).
    pub probe_dir: Option<PathBuf>,
    /// The expiring generation's pieces; `None`: as many as the runtime's
    /// rotation would give it (`expiry::pieces_for`).
    pub pieces: Option<u32>,
}

/// Purge speed: one sealed generation of `rows` claims is expired by
/// `expiry::purge` (detached concurrently and dropped) a third of the way
/// into a run of idem at a fixed rate; the time it took, and the latency of
/// the messages whose transactions overlapped it against the others'.
pub async fn purge(ctx: &Context, base: &Plan, p: &Purge) -> Result<Measurement, BenchError> {
    let layout = Layout {
        rows: 0,
        live: 1,
        expiring: vec![p.rows],
        pieces: p.pieces,
    };
    let db = fill(ctx, base, "purge", "expiring", &layout).await?;
    let plan = Plan {
        scenario: "purge",
        messages: p.messages,
        rate: Some(p.rate),
        prefill: p.rows,
        // The fill handler's: the router purges only every minute, and finds
        // nothing due until the generation is armed; the purge timed here is
        // the bench's own call.
        retention: Some(fixture::FILL_RETENTION),
        time_in_tx: true,
        wait_for_consumer: true,
        ..base.clone()
    };
    let delay = Duration::from_secs_f64(p.messages as f64 / p.rate / 3.0);
    let probes = start_probes(p, &db).await;
    let probes = match probes {
        Ok(probes) => probes,
        Err(e) => {
            db.drop().await;
            return Err(e);
        }
    };
    let before = last_purge(&db.pool).await;
    let (measured, purged) = tokio::join!(run_and_print(ctx, plan, Some(&db)), async {
        // The router purges once as it starts (then every minute): armed
        // before that run, the generation would be expired by it, not by
        // the purge timed here.
        routers_first_purge(&db.pool, before?).await?;
        tokio::time::sleep(delay).await;
        timed_purge(&db.pool).await
    });
    let (disk, looks) = (
        probes.0.map(stalls::DiskProbe::finish).unwrap_or_default(),
        probes.1.finish().await,
    );
    let after = fixture::generations(&db.pool).await;
    db.drop().await;
    let measured = measured?;
    let purged = purged?;
    let after = after.map_err(sql_failed)?;
    if !purged.report.expired.contains(&1) || after.2.contains(&1) {
        return Err(BenchError::failed(format!(
            "the purge did not expire the armed generation: {:?}, generations now {:?}",
            purged.report, after.2
        )));
    }
    let seconds = purged.elapsed.as_secs_f64();
    let (t0, t1) = (purged.started, purged.started + purged.elapsed);
    let (u0, u1) = (
        unix_micros(purged.started_at),
        unix_micros(purged.started_at + purged.elapsed),
    );
    // The messages published before the router took its first one waited
    // for its start-up (a second or more on a loaded machine): neither
    // window counts them.
    let ready = measured
        .samples
        .iter()
        .map(|s| s.acked)
        .min()
        .map(|first| first + WARM_UP);
    let mut during = Vec::new();
    let mut outside = Vec::new();
    let mut warming = 0;
    for s in &measured.samples {
        let latency = s.acked.saturating_duration_since(s.published);
        if ready.is_some_and(|ready| s.published < ready) {
            warming += 1;
        } else if s.published <= t1 && s.acked >= t0 {
            during.push(latency);
        } else {
            outside.push(latency);
        }
    }
    let timeline = timeline(&measured.samples, t0, t1);
    if warming > 0 {
        eprintln!(
            "idem-bench: [purge] {warming} messages published before the router's first ack \
             (plus {WARM_UP:?}) are left out of both windows"
        );
    }
    let mut claim_during = Vec::new();
    let mut claim_outside = Vec::new();
    for &(started_us, in_tx_us) in &measured.tx_samples {
        let latency = Duration::from_micros(in_tx_us.max(0).unsigned_abs());
        if started_us <= u1 && started_us + in_tx_us >= u0 {
            claim_during.push(latency);
        } else {
            claim_outside.push(latency);
        }
    }
    let stats = |mut v: Vec<Duration>| {
        v.sort_unstable();
        (
            v.len(),
            run::percentile_ms(&v, 0.99),
            run::percentile_ms(&v, 1.0),
        )
    };
    let (e2e_in, e2e_out) = (stats(during), stats(outside));
    let (claim_in, claim_out) = (stats(claim_during), stats(claim_outside));
    eprintln!(
        "\npurge: expired {} claims ({:.2} GiB freed) in {seconds:.3} s (detach concurrently, \
         then drop: {} pieces, one at a time, then the partition)",
        p.rows,
        gib(purged.report.freed_bytes as i64),
        purged.report.pieces_dropped
    );
    for (name, inside, out) in [("e2e", e2e_in, e2e_out), ("claim", claim_in, claim_out)] {
        eprintln!(
            "  {name:<5} during the purge: p99 {:>7.2} ms max {:>7.2} ms ({} msgs); \
             otherwise: p99 {:>7.2} ms max {:>7.2} ms ({} msgs)",
            inside.1, inside.2, inside.0, out.1, out.2, out.0
        );
    }
    eprintln!(
        "  e2e p99 by second of publishing (ms; * while the purge ran): {}",
        timeline
            .iter()
            .map(|(p99, during)| format!("{p99:.0}{}", if *during { "*" } else { "" }))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let stalls = stalls::summarize(
        &disk,
        &looks,
        purged.started,
        purged.started + purged.elapsed,
    );
    eprintln!("targets:");
    eprintln!(
        "{}",
        report::target(
            &format!("purge of {} claims", p.rows),
            Some(seconds),
            " s",
            |_| true
        )
    );
    eprintln!(
        "{}",
        report::target(
            "e2e p99 during the purge / otherwise <= 2x",
            Some(e2e_in.1 / e2e_out.1),
            "x",
            |v| v <= 2.0
        )
    );
    println!(
        "{}",
        json!({
            "mode": "purge",
            "rows": p.rows,
            "purge_s": round(seconds, 3),
            "freed_bytes": purged.report.freed_bytes,
            "pieces_dropped": purged.report.pieces_dropped,
            "warm_up_messages_left_out": warming,
            "expired": purged.report.expired,
            "purge_runs_skipped": purged.skipped,
            "e2e_during": { "messages": e2e_in.0, "p99_ms": round(e2e_in.1, 3), "max_ms": round(e2e_in.2, 3) },
            "e2e_otherwise": { "messages": e2e_out.0, "p99_ms": round(e2e_out.1, 3), "max_ms": round(e2e_out.2, 3) },
            "claim_during": { "messages": claim_in.0, "p99_ms": round(claim_in.1, 3), "max_ms": round(claim_in.2, 3) },
            "claim_otherwise": { "messages": claim_out.0, "p99_ms": round(claim_out.1, 3), "max_ms": round(claim_out.2, 3) },
            "stalls": stalls,
            "e2e_p99_ms_by_second": timeline.iter().map(|(p99, _)| round(*p99, 1)).collect::<Vec<_>>(),
            "purge_seconds": timeline.iter().enumerate().filter(|(_, (_, during))| *during).map(|(i, _)| i).collect::<Vec<_>>(),
        })
    );
    Ok(measured)
}

/// The disk probe (where the servers' files are known) and the wait
/// sampler, started before the run.
async fn start_probes(
    p: &Purge,
    db: &Database,
) -> Result<(Option<stalls::DiskProbe>, stalls::WaitSampler), BenchError> {
    let disk = p
        .probe_dir
        .as_deref()
        .map(stalls::DiskProbe::start)
        .transpose()?;
    let waits = stalls::WaitSampler::start(&db.pool.connect_options()).await?;
    Ok((disk, waits))
}

/// The e2e p99 of the messages published in each second of the run, and
/// whether the purge (from `t0` to `t1`) ran during that second.
fn timeline(samples: &[run::Sample], t0: Instant, t1: Instant) -> Vec<(f64, bool)> {
    let Some(first) = samples.iter().map(|s| s.published).min() else {
        return Vec::new();
    };
    let mut seconds: Vec<Vec<Duration>> = Vec::new();
    for s in samples {
        let second = s.published.saturating_duration_since(first).as_secs() as usize;
        if seconds.len() <= second {
            seconds.resize_with(second + 1, Vec::new);
        }
        seconds[second].push(s.acked.saturating_duration_since(s.published));
    }
    seconds
        .into_iter()
        .enumerate()
        .map(|(i, mut latencies)| {
            latencies.sort_unstable();
            let from = first + Duration::from_secs(i as u64);
            let to = from + Duration::from_secs(1);
            (run::percentile_ms(&latencies, 0.99), from <= t1 && to >= t0)
        })
        .collect()
}

/// How long after its first ack the router counts as started.
const WARM_UP: Duration = Duration::from_millis(500);

struct TimedPurge {
    report: expiry::PurgeReport,
    started: Instant,
    started_at: SystemTime,
    elapsed: Duration,
    /// Passes skipped because the router's own purge held the lock.
    skipped: u32,
}

/// Arms the first generation's expiry and runs `expiry::purge` until a pass
/// is not skipped (the router's background purge may hold its lock).
/// When a purge last succeeded (`idem_expiry_state`), if one did.
async fn last_purge(pool: &PgPool) -> Result<Option<f64>, BenchError> {
    sqlx::query_scalar("SELECT extract(epoch FROM last_success_at)::float8 FROM idem_expiry_state")
        .fetch_one(pool)
        .await
        .map_err(sql_failed)
}

/// Waits until a purge other than the one that succeeded at `before` has
/// succeeded: the router's first.
async fn routers_first_purge(pool: &PgPool, before: Option<f64>) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while last_purge(pool).await? == before {
        if Instant::now() > deadline {
            return Err(BenchError::failed(
                "the router's first purge did not succeed within 60 s".to_owned(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

async fn timed_purge(pool: &PgPool) -> Result<TimedPurge, BenchError> {
    sqlx::raw_sql(AssertSqlSafe(fixture::arm_expiry(1)))
        .execute(pool)
        .await
        .map_err(sql_failed)?;
    let mut skipped = 0;
    loop {
        let started = Instant::now();
        let started_at = SystemTime::now();
        let report = expiry::purge(pool)
            .await
            .map_err(|e| BenchError::failed(format!("expiry::purge: {e}")))?;
        let elapsed = started.elapsed();
        if !report.skipped {
            return Ok(TimedPurge {
                report,
                started,
                started_at,
                elapsed,
                skipped,
            });
        }
        skipped += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The handler name of the storage scenario: about ten characters.
const STORAGE_HANDLER: &str = "billing.v1";

/// Message ids for the storage scenario, as SQL over `g`
/// (generate_series): (name, expression).
const IDS: [(&str, &str); 2] = [
    ("uuid (36 bytes)", "gen_random_uuid()::text"),
    (
        "100 bytes",
        "'acme-payments:eu-west-1:invoice:' || gen_random_uuid() || ':' || lpad(g::text, 31, '0')",
    ),
];

/// Storage: bytes per claim, heap and indexes, of the claims table
/// (version 2) against version 1's `idem_processed_messages`, each filled
/// with `rows` claims one row at a time in random key order (as claims
/// arrive: the indexes grow by page splits), for two kinds of message id.
pub async fn storage(ctx: &Context, base: &Plan, rows: u64) -> Result<(), BenchError> {
    let mut results = Vec::new();
    for (id_name, id_sql) in IDS {
        for version in [1, 2] {
            let plan = Plan {
                scenario: "storage",
                prefill: 0,
                mode: Mode::Naive, // bench_effects only: the schema is ours to pick.
                ..base.clone()
            };
            let db = Database::create(ctx, &ctx.next_tag(), &plan).await?;
            let measured = storage_of(&db.pool, version, id_sql, rows).await;
            db.drop().await;
            let (heap, indexes) = measured?;
            let per = per_claim(heap + indexes, rows);
            eprintln!(
                "idem-bench: [storage] v{version}, ids {id_name}: {rows} claims, heap {:.1} MiB, \
                 indexes {:.1} MiB: {per:.1} bytes per claim",
                mib(heap),
                mib(indexes)
            );
            results.push((version, id_name, heap, indexes, per));
        }
    }
    eprintln!("\nbytes per claim (heap + indexes), {rows} claims:");
    eprintln!(
        "  {:<16} {:>12} {:>12} {:>8}",
        "ids", "version 1", "version 2", "v2 / v1"
    );
    for (id_name, _) in IDS {
        let of = |version| {
            results
                .iter()
                .find(|r| r.0 == version && r.1 == id_name)
                .map_or(f64::NAN, |r| r.4)
        };
        eprintln!(
            "  {id_name:<16} {:>12.1} {:>12.1} {:>7.2}x",
            of(1),
            of(2),
            of(2) / of(1)
        );
    }
    let lines: Vec<_> = results
        .iter()
        .map(|(version, ids, heap, indexes, per)| {
            json!({
                "schema_version": version,
                "ids": ids,
                "heap_bytes": heap,
                "index_bytes": indexes,
                "bytes_per_claim": round(*per, 1),
            })
        })
        .collect();
    println!(
        "{}",
        json!({ "mode": "storage", "rows": rows, "handler": STORAGE_HANDLER, "results": lines })
    );
    Ok(())
}

/// Fills schema `version`'s dedup table with `rows` claims of ids `id_sql`
/// and returns its (heap, index) bytes.
async fn storage_of(
    pool: &PgPool,
    version: i64,
    id_sql: &str,
    rows: u64,
) -> Result<(i64, i64), BenchError> {
    let schema_failed = |e: idem_runtime::Error| BenchError::setup(format!("idem schema: {e}"));
    let fill = if version == 1 {
        schema::migrate_to(pool, 1).await.map_err(schema_failed)?;
        format!(
            "INSERT INTO idem_processed_messages (handler, message_id)
             SELECT '{STORAGE_HANDLER}', {id_sql} FROM generate_series(1, {rows}) AS g"
        )
    } else {
        schema::migrate(pool).await.map_err(schema_failed)?;
        format!(
            "WITH h AS (INSERT INTO idem_handlers (name, retention)
                        VALUES ('{STORAGE_HANDLER}', interval '7 days') RETURNING id)
             INSERT INTO idem_claims (key, gen, handler_id)
             SELECT idem_key('{STORAGE_HANDLER}', {id_sql}), 1, h.id
               FROM generate_series(1, {rows}) AS g, h"
        )
    };
    sqlx::query(AssertSqlSafe(fill))
        .execute(pool)
        .await
        .map_err(sql_failed)?;
    let sizes = if version == 1 {
        sqlx::raw_sql("VACUUM ANALYZE idem_processed_messages")
            .execute(pool)
            .await
            .map_err(sql_failed)?;
        sqlx::query_as(
            "SELECT pg_table_size('idem_processed_messages')::int8,
                    pg_indexes_size('idem_processed_messages')::int8",
        )
        .fetch_one(pool)
        .await
    } else {
        sqlx::raw_sql("VACUUM ANALYZE idem_claims")
            .execute(pool)
            .await
            .map_err(sql_failed)?;
        let mut conn = pool.acquire().await.map_err(sql_failed)?;
        fixture::sizes(&mut conn).await
    };
    sizes.map_err(sql_failed)
}

fn sql_failed(e: sqlx::Error) -> BenchError {
    BenchError::failed(format!("SQL: {e}"))
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

fn gib(bytes: i64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn per_claim(bytes: i64, rows: u64) -> f64 {
    if rows == 0 {
        f64::NAN
    } else {
        bytes as f64 / rows as f64
    }
}

fn unix_micros(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}
