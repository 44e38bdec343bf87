//! The SQLite kill run: the chaos suite's kill mode, on SQLite, with a
//! worker written from the docs alone (`src/bin/sqlite_worker.rs`). The run
//! and its proofs are [`idem_tests::kill_run`]'s: 600 credits at 60/s, the
//! worker SIGKILLed eight times (aimed kills inside open transactions,
//! which hold SQLite's write lock, and one between COMMIT and ack),
//! nats-server once, then exactly once checked.

use std::path::PathBuf;

use idem_tests::kill_run::{KillDatabase, KillWorker, kill_run};

/// A database file in a temp dir of its own; the first worker makes it.
struct SqliteFile {
    _dir: tempfile::TempDir,
    file: PathBuf,
}

impl SqliteFile {
    fn new() -> SqliteFile {
        let dir = tempfile::tempdir().expect("a temp dir");
        let file = dir.path().join("ledger.db");
        SqliteFile { _dir: dir, file }
    }
}

impl KillDatabase for SqliteFile {
    type Pool = sqlx::SqlitePool;

    fn url(&self) -> String {
        format!("sqlite://{}", self.file.display())
    }

    async fn pool(&self) -> sqlx::SqlitePool {
        idem_tests::sqlite::pool(&self.file).await
    }
}

const WORKER: KillWorker = KillWorker {
    binary: env!("CARGO_BIN_EXE_sqlite_worker"),
    handler: "sqlite-credit",
    durable: "sqlite-credit",
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_apply_every_message_once_with_default_batching() {
    idem_tests::require_own_servers();
    kill_run(WORKER, &SqliteFile::new(), "default").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_apply_every_message_once_per_message() {
    idem_tests::require_own_servers();
    kill_run(WORKER, &SqliteFile::new(), "1").await;
}
