//! The MariaDB kill run: the chaos suite's kill mode, on MariaDB, with
//! `src/bin/mariadb_worker.rs`. The run and its proofs are
//! [`idem_tests::kill_run`]'s: 600 credits at 60/s, the worker SIGKILLed
//! eight times (aimed kills inside open transactions, whose claims' locks
//! the server holds until it sees the connection gone, and one between
//! COMMIT and ack), nats-server once, then exactly once checked.

use idem_test::harness::Mariadb;
use idem_tests::kill_run::{KillDatabase, KillWorker, kill_run};

/// The run's MariaDB server, with an empty database; the first worker
/// makes the tables.
struct Server(Mariadb);

impl KillDatabase for Server {
    type Pool = sqlx::MySqlPool;

    fn url(&self) -> String {
        self.0.url()
    }

    async fn pool(&self) -> sqlx::MySqlPool {
        self.0.pool().await
    }
}

const WORKER: KillWorker = KillWorker {
    binary: env!("CARGO_BIN_EXE_mariadb_worker"),
    handler: "mariadb-credit",
    durable: "mariadb-credit",
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_apply_every_message_once_with_default_batching() {
    idem_tests::require_own_servers();
    kill_run(WORKER, &Server(Mariadb::start().await), "default").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_apply_every_message_once_per_message() {
    idem_tests::require_own_servers();
    kill_run(WORKER, &Server(Mariadb::start().await), "1").await;
}
