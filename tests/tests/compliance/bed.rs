//! What every test of the suite starts from, whatever the database.

use std::any::Any;
use std::time::Duration;

use async_nats::jetstream;
use idem_tests::scenario::{create_stream, deposit, publish};
use idem_tests::unique_name;

/// The business table every handler of the suite writes: one row per
/// applied effect, with no unique key, so that a double-apply would show.
/// The same text for every database.
pub const EFFECTS: &str = "CREATE TABLE effects (
    handler   TEXT   NOT NULL,
    msg_id    TEXT   NOT NULL,
    account   TEXT   NOT NULL,
    amount    BIGINT NOT NULL,
    delivered BIGINT NOT NULL
)";

/// Records one effect (see [`EFFECTS`]).
pub const RECORD: &str = "INSERT INTO effects (handler, msg_id, account, amount, delivered)
                          VALUES ($1, $2, $3, $4, $5)";

/// (effects, distinct messages) of one handler.
pub const LEDGER: &str = "SELECT count(*), count(DISTINCT msg_id) FROM effects WHERE handler = $1";

/// A nats-server, a stream on `<stream>.deposit`, and a migrated database
/// holding [`EFFECTS`], reached through two pools (two workers).
pub struct Bed<P> {
    pub nats: async_nats::Client,
    pub js: jetstream::Context,
    /// The first worker's pool.
    pub pool: P,
    /// Another pool on the same database: a second worker.
    pub second_pool: P,
    pub stream: String,
    pub subject: String,
    /// The servers and files, dropped last.
    _servers: Box<dyn Any + Send>,
}

impl<P> Bed<P> {
    /// A bed on a database the store has prepared, and a fresh stream.
    pub async fn new(
        servers: Box<dyn Any + Send>,
        nats: async_nats::Client,
        pool: P,
        second_pool: P,
        prefix: &str,
    ) -> Bed<P> {
        let js = jetstream::new(nats.clone());
        let stream = unique_name(prefix);
        let subject = format!("{stream}.deposit");
        create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        Bed {
            nats,
            js,
            pool,
            second_pool,
            stream,
            subject,
            _servers: servers,
        }
    }

    /// Publishes a deposit of 1 under each id; how many.
    pub async fn publish(&self, ids: impl IntoIterator<Item = String>) -> usize {
        let mut published = 0;
        for id in ids {
            publish(&self.js, &self.subject, &deposit(&id, 1), Some(&id)).await;
            published += 1;
        }
        published
    }
}
