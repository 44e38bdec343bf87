//! What MariaDB's relay leaves on the connections it borrows: a cycle runs
//! at READ COMMITTED with its own bounds (`idle_transaction_timeout`,
//! `innodb_lock_wait_timeout`), session settings that would outlive it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::outbox::{self, Outbox, Relay};
use idem_tests::scenario::{create_stream, eventually};
use idem_tests::unique_name;

use crate::Bed;

/// The application's own session settings, set on each new connection.
const OWN_SETTINGS: &str =
    "SET SESSION innodb_lock_wait_timeout = 7, idle_transaction_timeout = 3600";

/// Connections the test's pool opened (its `after_connect` ran).
static OPENED: AtomicUsize = AtomicUsize::new(0);

/// A relay publishes rows (its fresh lane), records a failing row's
/// failure and retries it (its retry lane), on a pool of two connections
/// whose sessions carry the application's settings. Afterwards both
/// connections are the pool's first two, and carry the application's
/// settings and the server's isolation, not the relay's.
#[tokio::test]
async fn a_relays_connections_go_back_with_the_applications_settings() {
    let bed = Bed::start("MARIARELAY").await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|connection, _| {
            Box::pin(async move {
                OPENED.fetch_add(1, Ordering::SeqCst);
                sqlx::raw_sql(OWN_SETTINGS).execute(connection).await?;
                Ok(())
            })
        })
        .connect_with(bed.mariadb.options())
        .await
        .unwrap();
    let out = unique_name("MARIARELAYOUT");
    create_stream(&bed.js, &out, &format!("{out}.>"), Duration::from_secs(60)).await;
    let outbox: Outbox = Outbox::keyed("relay-session");
    let mut tx = pool.begin().await.unwrap();
    for i in 0..10 {
        outbox
            .send(&mut tx, &format!("{out}.fine"), &i)
            .await
            .unwrap();
    }
    outbox.send(&mut tx, "nowhere.lost", &0).await.unwrap();
    tx.commit().await.unwrap();

    let relay = Relay::new();
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run_until(bed.nats.clone(), pool.clone(), async move {
        let _ = stopped.await;
    }));
    eventually(
        "the good rows go out and the failing one is retried",
        Duration::from_secs(30),
        || async {
            let lag = outbox::lag(&pool).await.unwrap();
            lag.pending == 1 && lag.failures.first().is_some_and(|f| f.attempts >= 2)
        },
    )
    .await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    assert_eq!(
        stats.published(),
        10,
        "the fresh lane published every good row"
    );
    assert!(
        stats.failed() >= 2,
        "the retry lane ran: {}",
        stats.failed()
    );

    let mut held = Vec::new();
    for _ in 0..2 {
        let mut connection = pool.acquire().await.expect("a connection");
        let session: (i64, i64, String) = sqlx::query_as(
            "SELECT CAST(@@session.innodb_lock_wait_timeout AS SIGNED),
                    CAST(@@session.idle_transaction_timeout AS SIGNED),
                    @@session.tx_isolation",
        )
        .fetch_one(&mut *connection)
        .await
        .unwrap();
        assert_eq!(
            session,
            (7, 3600, "REPEATABLE-READ".to_owned()),
            "the session's settings are the application's"
        );
        held.push(connection);
    }
    assert_eq!(
        OPENED.load(Ordering::SeqCst),
        2,
        "the pool's two connections were kept, never closed and replaced"
    );
}
