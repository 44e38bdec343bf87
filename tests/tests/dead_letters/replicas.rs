//! idem's own streams on a 3-node cluster (issue 18, item 12): the
//! dead-letter and advisory streams a router creates follow the replicas of
//! its routes' streams, and one an operator made with fewer is left as it
//! is, with a warning at start-up that names both.
//!
//! One test in this file: it installs the process's `tracing` subscriber
//! itself, to read the warnings back.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::{Delivery, Route, Router, dead_letter, idempotent};
use idem_tests::ClusterEnv;
use idem_tests::scenario::*;

/// Everything logged at `warn` and above, kept for the test to read.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Installs a subscriber that writes here; before anything else logs.
    fn capture() -> Logs {
        let logs = Logs::default();
        let writer = logs.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        logs
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        // And to the test's output too, as the harness's subscriber would.
        eprint!("{}", String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn deposit(account: &str) -> Deposit {
    Deposit {
        account: account.into(),
        amount: 1,
    }
}

#[idempotent(name = "replicated")]
async fn replicated(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "replicated", &d, delivery).await
}

async fn replicas(js: &jetstream::Context, stream: &str) -> usize {
    js.get_stream(stream)
        .await
        .unwrap_or_else(|error| panic!("stream {stream}: {error}"))
        .info()
        .await
        .unwrap()
        .config
        .num_replicas
}

/// A route on an R3 stream: the router creates `IDEM_DEAD_LETTERS` and
/// `IDEM_ADVISORIES` with three replicas too (they were R1, and a lost node
/// took its dead letters with it). Then, with an `IDEM_DEAD_LETTERS` an
/// operator made at R1, a router starts as before, leaves it at R1, and
/// warns, naming both streams and their replicas.
#[tokio::test]
async fn dead_letter_and_advisory_streams_follow_the_routes_replicas() {
    let logs = Logs::capture();
    let env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.cluster.jetstream().await;
    let stream = unique_name("REPLICATED");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        num_replicas: 3,
        ..Default::default()
    })
    .await
    .unwrap();

    let run = async |id: &str| {
        // On a cluster, a stream just made may not answer every node yet.
        let payload = serde_json::to_vec(&deposit(id)).expect("deposit encodes");
        publish_with_id(&js, &format!("{stream}.deposit"), payload, id).await;
        let (handle, task) = spawn(
            Router::new().route(Route::new(&stream, "c"), replicated),
            env.cluster.client().await,
            pool.clone(),
        );
        let stats = handle.stats("c").unwrap();
        eventually(
            "the router processed its message",
            Duration::from_secs(60),
            || async { stats.processed() == 1 },
        )
        .await;
        stop(handle, task).await;
    };
    run("r-1").await;
    assert_eq!(
        (
            replicas(&js, dead_letter::DEFAULT_STREAM).await,
            replicas(&js, idem_runtime::ADVISORY_STREAM).await
        ),
        (3, 3),
        "(dead letters, advisories) replicas, for a route on an R3 stream"
    );

    // An operator's dead-letter stream with one replica.
    js.delete_stream(dead_letter::DEFAULT_STREAM).await.unwrap();
    js.create_stream(stream::Config {
        name: dead_letter::DEFAULT_STREAM.to_owned(),
        subjects: vec![dead_letter::DEFAULT_SUBJECTS.to_owned()],
        num_replicas: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    run("r-2").await;
    assert_eq!(
        replicas(&js, dead_letter::DEFAULT_STREAM).await,
        1,
        "an operator's stream is not changed"
    );
    let warning = logs
        .text()
        .lines()
        .find(|line| line.contains("WARN") && line.contains(dead_letter::DEFAULT_STREAM))
        .map(str::to_owned);
    let warning =
        warning.unwrap_or_else(|| panic!("no warning names the stream:\n{}", logs.text()));
    assert_eq!(ledger(&pool, "replicated").await, Ledger::once_each(2));
    assert!(
        warning.contains(&stream) && warning.contains('3') && warning.contains('1'),
        "the warning names both streams and their replicas: {warning}"
    );
}
