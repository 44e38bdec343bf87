//! Dedup tables of any size for the retention scenarios, generated straight
//! into the claims table's partitions: not through the broker, and not one
//! claim at a time.
//!
//! The schema is the runtime's (`schema::migrate`); this module adds rows,
//! and the bookkeeping of generations (`idem_generations`,
//! `idem_dedup_state`) that the purge would have written had the claims
//! been made over the past day. Each generation is loaded as a table of its
//! own, the way the purge makes a new one:
//!
//! 1. `CREATE TABLE .. (LIKE idem_claims ..)` with the generation's CHECK,
//!    and `COPY .. FROM STDIN (FORMAT binary, FREEZE)` in the same
//!    transaction: the rows arrive frozen and all-visible, as autovacuum
//!    leaves a sealed generation, so no VACUUM pass is needed and a probe
//!    is an index-only scan, as it would be in production;
//! 2. its primary key, built in one sort after the load, with fillfactor
//!    70: about the density of a b-tree that grew by random inserts, as a
//!    generation's does, so that probes touch as many pages as they would;
//! 3. `ATTACH PARTITION`, which adopts that index and, thanks to the CHECK
//!    constraint, skips the scan for the partition bound.
//!
//! Keys are random 16-byte values, as the runtime's SHA-256 keys are.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::{StreamExt, TryStreamExt};
use idem_runtime::retention::expiry;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::sync::Mutex;

use crate::BenchError;

/// The handler the generated claims belong to.
pub const FILL_HANDLER: &str = "bench.fill.v1";

/// The fill handler's retention, the longest registered, so the one the
/// purge applies: generations of half a day, expired a day after sealing.
pub const FILL_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Generations loaded at once, each by its own connection (the machine
/// this was written on has two cores).
const LOAD_PARALLELISM: usize = 2;

/// About what a claim takes, heap and index (`idem-bench storage`).
const BYTES_PER_CLAIM: u64 = 113;

/// Rows per COPY message.
const CHUNK_ROWS: usize = 32_768;

/// A dedup table to generate.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Claims in the live generations, spread evenly over them.
    pub rows: u64,
    /// Live generations: the current one and the sealed ones before it,
    /// all within the retention.
    pub live: u32,
    /// Older sealed generations, one per entry, with that many claims: each
    /// is expired by the purge once [`arm_expiry`] dates its seal past the
    /// retention.
    pub expiring: Vec<u64>,
    /// Pieces per generation; `None`: as many as the purge's rotation
    /// would give it after a predecessor of its size.
    pub pieces: Option<u32>,
}

impl Layout {
    /// The generations, oldest first: (number, rows, role).
    fn generations(&self) -> Vec<(i32, u64, Role)> {
        let mut out = Vec::new();
        let mut number = 0;
        for &rows in &self.expiring {
            number += 1;
            out.push((number, rows, Role::Expiring));
        }
        let live = u64::from(self.live.max(1));
        for i in 0..live {
            number += 1;
            // The remainder goes to the current generation.
            let rows = if i + 1 == live {
                self.rows - self.rows / live * (live - 1)
            } else {
                self.rows / live
            };
            let role = if i + 1 == live {
                Role::Current
            } else {
                Role::Sealed
            };
            out.push((number, rows, role));
        }
        out
    }

    /// The pieces of a generation of `rows` claims.
    pub fn pieces_of(&self, rows: u64) -> u32 {
        self.pieces.unwrap_or_else(|| {
            expiry::pieces_for(rows * BYTES_PER_CLAIM, expiry::DEFAULT_PIECE_BYTES)
        })
    }

    pub fn total_rows(&self) -> u64 {
        self.rows + self.expiring.iter().sum::<u64>()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    /// Sealed before the retention started to run out, but kept from
    /// expiring until armed.
    Expiring,
    /// Sealed when its successor opened, within the retention.
    Sealed,
    Current,
}

/// What loading took, and what it made.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub rows: u64,
    pub generations: usize,
    pub elapsed: Duration,
    /// Heap and indexes of every partition, in bytes.
    pub table_bytes: i64,
    pub index_bytes: i64,
}

/// Fills the claims table of `pool`'s database, freshly migrated and with
/// no claims, with `layout`.
pub async fn load(
    pool: &PgPool,
    layout: &Layout,
    say: &(dyn Fn(&str) + Sync),
) -> Result<Loaded, BenchError> {
    let started = Instant::now();
    let sql = |what: &'static str| move |e: sqlx::Error| BenchError::setup(format!("{what}: {e}"));
    let handler: i32 = sqlx::query_scalar(
        "INSERT INTO idem_handlers (name, retention)
         VALUES ($1, $2::bigint * interval '1 second') RETURNING id",
    )
    .bind(FILL_HANDLER)
    .bind(FILL_RETENTION.as_secs() as i64)
    .fetch_one(pool)
    .await
    .map_err(sql("register the fill handler"))?;
    // The migration's first generation goes: each is loaded as a table of
    // its own and attached.
    sqlx::raw_sql(
        "ALTER TABLE idem_claims DETACH PARTITION idem_claims_g1;
         DROP TABLE idem_claims_g1;
         DELETE FROM idem_generations;",
    )
    .execute(pool)
    .await
    .map_err(sql("drop the first generation"))?;

    let generations = layout.generations();
    let total = layout.total_rows();
    say(&format!(
        "generating {total} claims in {} generations ({} expiring, {} live)",
        generations.len(),
        layout.expiring.len(),
        layout.live
    ));
    let length = expiry::generation_length(FILL_RETENTION);
    let now = SystemTime::now();
    let current = generations.last().map_or(1, |g| g.0);
    let loaded = Arc::new(Mutex::new(0u64));
    futures_util::stream::iter(generations.iter().copied())
        .map(|(number, rows, _)| {
            let loaded = loaded.clone();
            async move {
                let opened = opened_at(now, length, current - number);
                let pieces = layout.pieces_of(rows);
                load_generation(pool, number, rows, pieces, handler, opened).await?;
                let mut done = loaded.lock().await;
                *done += rows;
                say(&format!(
                    "generation {number}: {rows} claims loaded and indexed; {} of {total} in \
                     {:.0} s",
                    *done,
                    started.elapsed().as_secs_f64()
                ));
                Ok::<_, BenchError>(())
            }
        })
        .buffer_unordered(LOAD_PARALLELISM)
        .try_collect::<Vec<()>>()
        .await?;

    let mut conn = pool.acquire().await.map_err(sql("a connection"))?;
    for &(number, _, role) in &generations {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE idem_claims ATTACH PARTITION idem_claims_g{number} FOR VALUES IN ({number})"
        )))
        .execute(&mut *conn)
        .await
        .map_err(sql("attach a generation"))?;
        let opened = opened_at(now, length, current - number);
        let sealed = match role {
            Role::Current => None,
            // About when its successor opened.
            Role::Sealed => Some(opened_at(now, length, current - number - 1)),
            // Just inside the retention, until armed.
            Role::Expiring => Some(now - FILL_RETENTION + Duration::from_secs(3600)),
        };
        sqlx::query(
            "INSERT INTO idem_generations (gen, opened_at, sealed_at)
             VALUES ($1, to_timestamp($2), to_timestamp($3))",
        )
        .bind(number)
        .bind(unix_seconds(opened))
        .bind(sealed.map(unix_seconds))
        .execute(&mut *conn)
        .await
        .map_err(sql("record a generation"))?;
    }
    sqlx::query(
        "UPDATE idem_dedup_state SET current_gen = $1, transition = false, waiting_for = NULL",
    )
    .bind(current)
    .execute(&mut *conn)
    .await
    .map_err(sql("make the newest generation current"))?;
    // The claim's plan reads the state and generations tables too.
    sqlx::raw_sql("ANALYZE idem_claims; ANALYZE idem_generations; ANALYZE idem_dedup_state")
        .execute(&mut *conn)
        .await
        .map_err(sql("analyze the claims"))?;
    let (table_bytes, index_bytes) = sizes(&mut conn).await.map_err(sql("sizes"))?;
    drop(conn);
    Ok(Loaded {
        rows: total,
        generations: generations.len(),
        elapsed: started.elapsed(),
        table_bytes,
        index_bytes,
    })
}

/// When a generation was opened: the current one half a generation ago
/// (not due to rotate until [`arm_rotation`]), the ones before it a
/// generation length earlier each.
fn opened_at(now: SystemTime, length: Duration, behind_current: i32) -> SystemTime {
    let behind = u32::try_from(behind_current.max(0)).unwrap_or(0);
    now - length / 2 - length * behind
}

fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Creates `idem_claims_g<number>` as a table of its own (in `pieces`
/// hash partitions if more than one), COPYs `rows` random claims into it,
/// and builds its primary key.
async fn load_generation(
    pool: &PgPool,
    number: i32,
    rows: u64,
    pieces: u32,
    handler: i32,
    claimed_at: SystemTime,
) -> Result<(), BenchError> {
    let sql = |what: &'static str| {
        move |e: sqlx::Error| BenchError::setup(format!("generation {number}: {what}: {e}"))
    };
    let mut conn = PgConnection::connect_with(&pool.connect_options())
        .await
        .map_err(sql("connect"))?;
    sqlx::raw_sql("SET maintenance_work_mem = '1GB'; SET max_parallel_maintenance_workers = 1")
        .execute(&mut conn)
        .await
        .map_err(sql("settings"))?;
    let mut tx = conn.begin().await.map_err(sql("begin"))?;
    let mut create = format!(
        "CREATE TABLE idem_claims_g{number} (LIKE idem_claims INCLUDING DEFAULTS,
                                            CHECK (gen = {number}))"
    );
    if pieces > 1 {
        // As the purge's rotation makes a large generation (see the
        // runtime's `expiry` module, *Pieces*).
        create.push_str(" PARTITION BY HASH (key);");
        for piece in 0..pieces {
            create.push_str(&format!(
                "CREATE TABLE idem_claims_g{number}_p{piece} PARTITION OF idem_claims_g{number}
                   FOR VALUES WITH (MODULUS {pieces}, REMAINDER {piece});"
            ));
        }
    }
    sqlx::raw_sql(AssertSqlSafe(create))
        .execute(&mut *tx)
        .await
        .map_err(sql("create"))?;
    // FREEZE is refused on a partitioned table: its pieces are frozen by a
    // VACUUM after the load instead.
    let freeze = if pieces > 1 { "" } else { ", FREEZE" };
    let mut copy = tx
        .copy_in_raw(&format!(
            "COPY idem_claims_g{number} (key, gen, handler_id, claimed_at, result) \
             FROM STDIN (FORMAT binary{freeze})"
        ))
        .await
        .map_err(sql("COPY"))?;
    let claimed_us = pg_micros(claimed_at);
    let mut rng = u64::from(number.unsigned_abs()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), number);
    let mut buffer = Vec::with_capacity(19 + CHUNK_ROWS * ROW_BYTES);
    buffer.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    buffer.extend_from_slice(&0i32.to_be_bytes()); // flags
    buffer.extend_from_slice(&0i32.to_be_bytes()); // header extension
    let mut left = rows;
    loop {
        let chunk = left.min(CHUNK_ROWS as u64);
        for _ in 0..chunk {
            rng = splitmix64(rng);
            let a = rng;
            rng = splitmix64(rng);
            let b = rng;
            buffer.extend_from_slice(&5i16.to_be_bytes());
            buffer.extend_from_slice(&16i32.to_be_bytes());
            buffer.extend_from_slice(&a.to_be_bytes());
            buffer.extend_from_slice(&b.to_be_bytes());
            buffer.extend_from_slice(&4i32.to_be_bytes());
            buffer.extend_from_slice(&number.to_be_bytes());
            buffer.extend_from_slice(&4i32.to_be_bytes());
            buffer.extend_from_slice(&handler.to_be_bytes());
            buffer.extend_from_slice(&8i32.to_be_bytes());
            buffer.extend_from_slice(&claimed_us.to_be_bytes());
            buffer.extend_from_slice(&(-1i32).to_be_bytes()); // result: NULL
        }
        left -= chunk;
        if left == 0 {
            buffer.extend_from_slice(&(-1i16).to_be_bytes()); // trailer
        }
        copy.send(std::mem::take(&mut buffer))
            .await
            .map_err(sql("COPY data"))?;
        buffer.reserve(CHUNK_ROWS * ROW_BYTES);
        if left == 0 {
            break;
        }
    }
    copy.finish().await.map_err(sql("COPY end"))?;
    tx.commit().await.map_err(sql("commit"))?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE idem_claims_g{number} ADD PRIMARY KEY (key, gen) WITH (fillfactor = 70)"
    )))
    .execute(&mut conn)
    .await
    .map_err(sql("build the primary key"))?;
    if pieces > 1 {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "VACUUM (FREEZE, ANALYZE) idem_claims_g{number}"
        )))
        .execute(&mut conn)
        .await
        .map_err(sql("freeze the pieces"))?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// Bytes of one COPY row: a field count, then five fields with a length
/// each: the key (16), gen (4), handler_id (4), claimed_at (8), a NULL.
const ROW_BYTES: usize = 2 + (4 + 16) + (4 + 4) + (4 + 4) + (4 + 8) + 4;

/// Microseconds since 2000-01-01 UTC, PostgreSQL's timestamp epoch.
fn pg_micros(at: SystemTime) -> i64 {
    const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;
    let unix_us = at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    unix_us - PG_EPOCH_UNIX_SECS * 1_000_000
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Heap (with TOAST) and index bytes of every partition of the claims
/// table attached now.
pub async fn sizes(conn: &mut PgConnection) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT coalesce(sum(pg_table_size(relid)), 0)::int8,
                coalesce(sum(pg_indexes_size(relid)), 0)::int8
           FROM pg_partition_tree('idem_claims') WHERE isleaf",
    )
    .fetch_one(conn)
    .await
}

/// SQL that makes the current generation due to rotate `after` from when
/// it runs, for [`crate::run::Plan::before_consume`].
pub fn arm_rotation(after: Duration) -> String {
    let length = expiry::generation_length(FILL_RETENTION);
    format!(
        "UPDATE idem_generations g
            SET opened_at = now() - interval '{} milliseconds'
           FROM idem_dedup_state s
          WHERE g.gen = s.current_gen;",
        length.saturating_sub(after).as_millis()
    )
}

/// SQL that dates generation `number`'s seal past the retention, so that
/// the next purge expires it.
pub fn arm_expiry(number: i32) -> String {
    format!(
        "UPDATE idem_generations
            SET sealed_at = now() - interval '{} seconds'
          WHERE gen = {number};",
        FILL_RETENTION.as_secs() + 60
    )
}

/// The claims table's generations now: (current, in transition, attached
/// generations).
pub async fn generations(pool: &PgPool) -> Result<(i32, bool, Vec<i32>), sqlx::Error> {
    sqlx::query_as(
        "SELECT s.current_gen, s.transition,
                (SELECT coalesce(array_agg(gen ORDER BY gen), '{}') FROM idem_generations)
           FROM idem_dedup_state s",
    )
    .fetch_one(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_spreads_its_rows_and_numbers_its_generations() {
        let layout = Layout {
            rows: 10,
            live: 3,
            expiring: vec![4, 5],
            pieces: None,
        };
        let gens = layout.generations();
        let numbers: Vec<i32> = gens.iter().map(|g| g.0).collect();
        assert_eq!(numbers, [1, 2, 3, 4, 5]);
        let rows: Vec<u64> = gens.iter().map(|g| g.1).collect();
        assert_eq!(rows, [4, 5, 3, 3, 4]);
        assert_eq!(gens[0].2, Role::Expiring);
        assert_eq!(gens[2].2, Role::Sealed);
        assert_eq!(gens[4].2, Role::Current);
        assert_eq!(layout.total_rows(), 19);
    }

    #[test]
    fn copy_rows_and_timestamps() {
        assert_eq!(ROW_BYTES, 54);
        assert_eq!(
            pg_micros(UNIX_EPOCH + Duration::from_secs(946_684_800 + 1)),
            1_000_000
        );
    }
}
