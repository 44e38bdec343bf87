//! `idem dead-letters` against real servers, for two cases of issue 18: a
//! replay made from the command line after the stream's duplicate window,
//! of a message that was processed meanwhile (JetStream stores it, and only
//! the claim can skip it), and a dead letter whose payload was moved out of
//! it (`show` says where, `replay` sends it back).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::error::BoxError;
use idem_runtime::{Permanent, Route, Router, State, idempotent};
use idem_tests::{TestEnv, eventually};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;

#[derive(Debug, Serialize, Deserialize)]
struct Note {
    text: String,
}

/// Whether the handler still refuses: the bug fixed before a replay.
#[derive(Clone)]
struct Bug(Arc<AtomicBool>);

/// Books a note; refused (permanently) while the bug lasts.
#[idempotent(name = "cli.note.v1")]
async fn note(
    tx: &mut sqlx::PgTransaction<'_>,
    State(bug): State<Bug>,
    note: Note,
) -> Result<(), BoxError> {
    if bug.0.load(Ordering::SeqCst) {
        return Err(Permanent::new("notes are refused by a bug").into());
    }
    // No unique key: a note applied twice shows as two rows.
    sqlx::query("INSERT INTO notes (text) VALUES ($1)")
        .bind(note.text.len() as i64)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// One run of the `idem` binary: its exit code and stdout as JSON.
async fn idem_json(env: &TestEnv, args: &[&str]) -> (i32, Value, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env("NATS_URL", env.nats_url())
        .env("DATABASE_URL", env.database_url())
        .output()
        .await
        .expect("the idem binary runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    println!("$ idem {}\n{stdout}{stderr}", args.join(" "));
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (output.status.code().expect("idem exits"), json, stdout)
}

async fn setup(
    env: &TestEnv,
    prefix: &str,
    duplicate_window: Duration,
) -> (
    PgPool,
    async_nats::Client,
    jetstream::Context,
    String,
    String,
) {
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE notes (text bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = idem_tests::unique_name(prefix);
    let subject = format!("{stream}.note");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        duplicate_window,
        ..Default::default()
    })
    .await
    .unwrap();
    (pool, nats, js, stream, subject)
}

async fn publish(
    js: &jetstream::Context,
    subject: &str,
    text: &str,
    id: &str,
) -> jetstream::publish::PublishAck {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id);
    let payload = serde_json::to_vec(&Note {
        text: text.to_owned(),
    })
    .unwrap();
    js.publish_with_headers(subject.to_owned(), headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap()
}

async fn stream_messages(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

async fn notes(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM notes")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A note is dead-lettered by a bug; after the fix its publisher retries,
/// past the stream's 1 s duplicate window, and it is processed. Then the
/// operator replays its dead letter with `idem`, past the window again:
/// JetStream stores the replay (the CLI reports it `replayed`, and the
/// stream holds it), and the claim skips it: the note stays applied once,
/// and the route counts a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_replay_after_the_duplicate_window_is_stored_and_skipped_by_the_claim() {
    let env = TestEnv::start().await;
    let (pool, nats, js, stream, subject) = setup(&env, "CLI_WINDOW", Duration::from_secs(1)).await;
    publish(&js, &subject, "hello", "note-1").await;
    let bug = Bug(Arc::new(AtomicBool::new(true)));
    let router = Router::with_state(bug.clone()).route(Route::new(&stream, "notes"), note);
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool.clone(), std::future::pending()));
    let stats = handle.stats("notes").unwrap();
    eventually(
        "the message is dead-lettered",
        Duration::from_secs(30),
        async || stats.dead_lettered() == 1,
    )
    .await;

    bug.0.store(false, Ordering::SeqCst);
    // The publisher retries after the window: stored, processed.
    let retried = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ack = publish(&js, &subject, "hello", "note-1").await;
        if !ack.duplicate {
            break ack;
        }
    };
    assert_eq!(retried.sequence, 2);
    eventually(
        "the replay is processed",
        Duration::from_secs(30),
        async || stats.processed() == 1,
    )
    .await;

    // Past the window of the retry too.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let dead_subject = format!("idem.dead.{stream}.notes");
    let (code, replay, _) = idem_json(
        &env,
        &[
            "dead-letters",
            "replay",
            "--all",
            "--subject",
            &dead_subject,
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0, "{replay:#}");
    let outcome = &replay["dead_letters"][0];
    assert_eq!(
        outcome["outcome"], "replayed",
        "not a duplicate PubAck: {replay:#}"
    );
    assert_eq!(outcome["replayed_to"]["stream"], stream.as_str());
    assert_eq!(outcome["replayed_to"]["sequence"], 3);
    assert_eq!(
        stream_messages(&js, &stream).await,
        3,
        "JetStream stored the replay"
    );

    eventually(
        "the second replay is a duplicate",
        Duration::from_secs(30),
        async || stats.duplicates() == 1,
    )
    .await;
    handle.shutdown();
    task.await.unwrap().unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
    assert_eq!(notes(&pool).await, 1, "the replay was skipped by the claim");
}

/// A 100 KB note refused by the bug, on a route whose dead-letter stream
/// (the operator's) takes at most 16 KiB a message: its payload is moved
/// out of the dead letter. `idem dead-letters show` says so and where;
/// after the fix, `idem dead-letters replay --discard` sends the original
/// payload (applied once) and removes the moved payload with the dead
/// letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_says_where_a_moved_payload_is_and_replay_sends_it() {
    let env = TestEnv::start().await;
    let (pool, nats, js, stream, subject) =
        setup(&env, "CLI_MOVED", Duration::from_secs(120)).await;
    let dead_stream = format!("{stream}_DEAD");
    let dead_subject = format!("{stream}.dead");
    js.create_stream(stream::Config {
        name: dead_stream.clone(),
        subjects: vec![dead_subject.clone()],
        max_message_size: 16 * 1024,
        ..Default::default()
    })
    .await
    .unwrap();
    let text = "n".repeat(100_000);
    publish(&js, &subject, &text, "big-note").await;
    let bug = Bug(Arc::new(AtomicBool::new(true)));
    let router = Router::with_state(bug.clone()).route(
        Route::new(&stream, "notes").dead_letter_subject(&dead_subject),
        note,
    );
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool.clone(), std::future::pending()));
    let stats = handle.stats("notes").unwrap();
    eventually(
        "the message is dead-lettered",
        Duration::from_secs(30),
        async || stats.dead_lettered() == 1,
    )
    .await;

    let (code, shown, _) = idem_json(
        &env,
        &[
            "dead-letters",
            "--stream",
            &dead_stream,
            "show",
            "1",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    let moved = shown["payload_moved"].clone();
    assert_eq!(
        moved["bytes"],
        serde_json::to_vec(&Note { text: text.clone() })
            .unwrap()
            .len()
    );
    let object = moved["object"]
        .as_str()
        .expect("where the payload is")
        .to_owned();
    let bucket = moved["bucket"].as_str().expect("its bucket").to_owned();
    let (_, _, shown_text) = idem_json(
        &env,
        &["dead-letters", "--stream", &dead_stream, "show", "1"],
    )
    .await;
    assert!(
        shown_text.contains("moved")
            && shown_text.contains(&object)
            && shown_text.contains(&bucket),
        "{shown_text}"
    );

    bug.0.store(false, Ordering::SeqCst);
    let (code, replay, _) = idem_json(
        &env,
        &[
            "dead-letters",
            "--stream",
            &dead_stream,
            "replay",
            "1",
            "--discard",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0, "{replay:#}");
    assert_eq!(replay["dead_letters"][0]["discarded"], true);
    eventually(
        "the replay is processed",
        Duration::from_secs(30),
        async || stats.processed() == 1,
    )
    .await;
    handle.shutdown();
    task.await.unwrap().unwrap();
    let booked: i64 = sqlx::query_scalar("SELECT text FROM notes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(booked, 100_000, "the original payload was replayed");
    assert_eq!(notes(&pool).await, 1);
    let store = js.get_object_store(&bucket).await.unwrap();
    assert!(
        store.info(&object).await.is_ok_and(|info| info.deleted),
        "the moved payload went with its dead letter"
    );
}
