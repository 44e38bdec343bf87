//! What the servers wait for during a window of a run (the purge scenario's
//! expiry), against the rest of the run: an `fdatasync` probe on the disk
//! the servers write to, and samples of what PostgreSQL's backends wait on
//! (`pg_stat_activity`). They tell a stall of the disk (every commit and
//! every JetStream fsync waits) from a lock wait (only the transactions
//! behind one lock) or a stall in the WAL.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use crate::BenchError;
use crate::run::percentile_ms;

/// How often each probe looks.
const EVERY: Duration = Duration::from_millis(5);

/// Writes 8 KiB and `fdatasync`s it every [`EVERY`], in a file of its own
/// next to the servers' files, as a commit's WAL flush does.
pub struct DiskProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Instant, Duration)>>,
    path: PathBuf,
}

impl DiskProbe {
    pub fn start(dir: &Path) -> Result<DiskProbe, BenchError> {
        let path = dir.join(format!("idem-bench-disk-probe-{}", std::process::id()));
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)
            .map_err(|e| BenchError::setup(format!("disk probe {}: {e}", path.display())))?;
        let block = vec![0x5a_u8; 8192];
        // Allocated up front, so that each probe rewrites blocks in place
        // (as a recycled WAL segment is written) and allocates nothing.
        for i in 0..256 {
            file.write_all_at(&block, i * 8192)
                .map_err(|e| BenchError::setup(format!("disk probe: {e}")))?;
        }
        file.sync_all()
            .map_err(|e| BenchError::setup(format!("disk probe: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            let mut i = 0u64;
            while !stopping.load(Ordering::Relaxed) {
                let at = Instant::now();
                let written = file
                    .write_all_at(&block, (i % 256) * 8192)
                    .and_then(|()| file.sync_data());
                if written.is_err() {
                    break;
                }
                samples.push((at, at.elapsed()));
                i += 1;
                std::thread::sleep(EVERY);
            }
            samples
        });
        Ok(DiskProbe { stop, thread, path })
    }

    /// Stops it and returns each probe: when it started and how long it took.
    pub fn finish(self) -> Vec<(Instant, Duration)> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.join().unwrap_or_default();
        let _ = std::fs::remove_file(&self.path);
        samples
    }
}

/// One look at `pg_stat_activity`: the wait event of each active backend of
/// the database, by who it is (`claims` for the router's, `purge` for the
/// purge's).
type Look = (Instant, Vec<(String, String)>);

/// Samples what the database's active backends wait on, every [`EVERY`], on
/// a connection of its own.
pub struct WaitSampler {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Look>>,
}

impl WaitSampler {
    pub async fn start(options: &PgConnectOptions) -> Result<WaitSampler, BenchError> {
        let mut conn = PgConnection::connect_with(options)
            .await
            .map_err(|e| BenchError::setup(format!("wait sampler: {e}")))?;
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut looks = Vec::new();
            let mut ticks = tokio::time::interval(EVERY);
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    _ = ticks.tick() => {}
                }
                let at = Instant::now();
                let rows: Result<Vec<(String, String)>, _> = sqlx::query_as(
                    "SELECT CASE WHEN application_name LIKE '%idem purge%' THEN 'purge'
                                 ELSE 'claims' END,
                            coalesce(wait_event_type || ':' || wait_event, 'CPU')
                       FROM pg_stat_activity
                      WHERE datname = current_database() AND state = 'active'
                        AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                )
                .fetch_all(&mut conn)
                .await;
                match rows {
                    Ok(rows) => looks.push((at, rows)),
                    Err(_) => break,
                }
            }
            let _ = conn.close().await;
            looks
        });
        Ok(WaitSampler { stop, task })
    }

    pub async fn finish(self) -> Vec<Look> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

/// The probes' figures inside `[from, to]` against the rest, printed and as
/// JSON.
pub fn summarize(
    disk: &[(Instant, Duration)],
    looks: &[Look],
    from: Instant,
    to: Instant,
) -> serde_json::Value {
    let inside = |at: Instant, took: Duration| at <= to && at + took >= from;
    let (mut disk_in, mut disk_out): (Vec<Duration>, Vec<Duration>) = (Vec::new(), Vec::new());
    for &(at, took) in disk {
        if inside(at, took) {
            disk_in.push(took);
        } else {
            disk_out.push(took);
        }
    }
    disk_in.sort_unstable();
    disk_out.sort_unstable();
    let figures = |v: &[Duration]| {
        json!({
            "probes": v.len(),
            "p50_ms": round(percentile_ms(v, 0.5)),
            "p99_ms": round(percentile_ms(v, 0.99)),
            "max_ms": round(percentile_ms(v, 1.0)),
        })
    };
    eprintln!(
        "  disk  fdatasync of 8 KiB every {EVERY:?} next to the servers' files: during p50 {:.2} \
         p99 {:.2} max {:.2} ms ({} probes); otherwise p50 {:.2} p99 {:.2} max {:.2} ms",
        percentile_ms(&disk_in, 0.5),
        percentile_ms(&disk_in, 0.99),
        percentile_ms(&disk_in, 1.0),
        disk_in.len(),
        percentile_ms(&disk_out, 0.5),
        percentile_ms(&disk_out, 0.99),
        percentile_ms(&disk_out, 1.0),
    );
    // Per window: how many looks, and in how many of them some backend of
    // each kind waited on each event.
    let mut counts: [(usize, BTreeMap<String, usize>); 2] = Default::default();
    for (at, rows) in looks {
        let window = usize::from(!inside(*at, Duration::ZERO));
        counts[window].0 += 1;
        let mut seen: Vec<String> = rows
            .iter()
            .map(|(who, what)| format!("{who} {what}"))
            .collect();
        seen.sort_unstable();
        seen.dedup();
        for event in seen {
            *counts[window].1.entry(event).or_default() += 1;
        }
    }
    let share = |(looks, events): &(usize, BTreeMap<String, usize>)| {
        let mut shares: Vec<(String, f64)> = events
            .iter()
            .map(|(event, n)| (event.clone(), *n as f64 / (*looks).max(1) as f64))
            .collect();
        shares.sort_by(|a, b| b.1.total_cmp(&a.1));
        shares
    };
    let (during, otherwise) = (share(&counts[0]), share(&counts[1]));
    for (name, window, shares) in [
        ("during", counts[0].0, &during),
        ("otherwise", counts[1].0, &otherwise),
    ] {
        let top: Vec<String> = shares
            .iter()
            .take(8)
            .map(|(event, share)| format!("{event} {:.1}%", share * 100.0))
            .collect();
        eprintln!(
            "  waits {name:<9} ({window} looks; share of looks where a backend waited so): {}",
            top.join(", ")
        );
    }
    let as_json = |shares: &[(String, f64)]| {
        shares
            .iter()
            .map(|(event, share)| (event.clone(), json!(round(share * 100.0))))
            .collect::<serde_json::Map<_, _>>()
    };
    json!({
        "disk_during": figures(&disk_in),
        "disk_otherwise": figures(&disk_out),
        "waits_during_pct": as_json(&during),
        "waits_otherwise_pct": as_json(&otherwise),
    })
}

fn round(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}
