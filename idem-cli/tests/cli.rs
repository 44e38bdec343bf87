//! The `idem` command against real servers: a known workload runs through a
//! real router (some credits processed, some dead-lettered by a handler
//! that fails permanently on an unknown account), then the built `idem`
//! binary runs as a process, and its `--json` output and exit codes are
//! checked against what the run did: status numbers, the dead letters and
//! their reasons, a dry run that changes nothing, a bulk replay (after the
//! cause is fixed) that applies each credit once, a second replay that is
//! refused and applies nothing, and a discard that removes them.

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::error::{Classify, ErrorClass};
use idem_runtime::{Route, Router, idempotent};
use idem_tests::{TestEnv, eventually};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{Connection, PgPool};

use common::{Run, idem_in};

const HANDLER: &str = "cli.credit.v1";
const DURABLE: &str = "ledger";
/// The account the first run does not know: its credits are dead-lettered.
const UNKNOWN_ACCOUNT: i64 = 99;

#[derive(Debug, Serialize, Deserialize)]
struct Credit {
    transfer: String,
    account: i64,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum LedgerError {
    #[error("account {0} does not exist")]
    UnknownAccount(i64),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Classify for LedgerError {
    fn class(&self) -> ErrorClass {
        match self {
            LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
            LedgerError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// Books a credit, deduplicated by its transfer id; an unknown account is
/// a permanent failure, so the credit is dead-lettered at once.
#[idempotent(name = "cli.credit.v1", key = credit.transfer)]
async fn credit(tx: &mut sqlx::PgTransaction<'_>, credit: Credit) -> Result<(), LedgerError> {
    let known: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM accounts WHERE id = $1)")
        .bind(credit.account)
        .fetch_one(&mut **tx)
        .await?;
    if !known {
        return Err(LedgerError::UnknownAccount(credit.account));
    }
    // No unique key: a credit applied twice would show as two rows.
    sqlx::query("INSERT INTO entries (transfer, account, amount) VALUES ($1, $2, $3)")
        .bind(&credit.transfer)
        .bind(credit.account)
        .bind(credit.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Runs `idem args...` with the test's servers in NATS_URL and
/// DATABASE_URL, as a service's operator would.
async fn idem(env: &TestEnv, args: &[&str]) -> Run {
    idem_with(Some(env.nats_url()), env.database_url(), args).await
}

/// Runs `idem args...` with these URLs (no NATS_URL at all for `None`).
async fn idem_with(nats_url: Option<&str>, database_url: &str, args: &[&str]) -> Run {
    idem_in(None, nats_url, database_url, args).await
}

async fn publish(js: &jetstream::Context, subject: &str, transfer: &str, account: i64) {
    let credit = Credit {
        transfer: transfer.to_owned(),
        account,
        amount: 100,
    };
    js.publish(
        subject.to_owned(),
        serde_json::to_vec(&credit).unwrap().into(),
    )
    .await
    .expect("publish is sent")
    .await
    .expect("publish is acknowledged");
}

async fn last_sequence(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .expect("stream exists")
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence
}

/// Waits until the consumer has acked every message of its stream.
async fn wait_settled(js: &jetstream::Context, stream: &str) {
    eventually(
        "the consumer acks every message of its stream",
        Duration::from_secs(60),
        async || {
            let last = last_sequence(js, stream).await;
            let Ok(info) = js
                .get_stream_no_info(stream)
                .await
                .expect("stream exists")
                .consumer_info(DURABLE)
                .await
            else {
                return false;
            };
            info.num_pending == 0
                && info.num_ack_pending == 0
                && info.ack_floor.stream_sequence >= last
        },
    )
    .await;
}

/// Every credit booked: (transfer, times booked), by transfer.
async fn entries(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT transfer, count(*) FROM entries GROUP BY transfer ORDER BY transfer")
        .fetch_all(pool)
        .await
        .expect("entries are read")
}

fn transfers(range: impl IntoIterator<Item = u32>) -> Vec<String> {
    range.into_iter().map(|n| format!("t-{n:02}")).collect()
}

fn start_router(
    stream: &str,
    subject: &str,
    nats: async_nats::Client,
    pool: PgPool,
) -> (
    idem_runtime::RouterHandle,
    tokio::task::JoinHandle<Result<(), idem_runtime::Error>>,
) {
    let router = Router::new().route(Route::new(stream, DURABLE).filter_subject(subject), credit);
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool, std::future::pending()));
    (handle, task)
}

async fn stop_router(
    handle: idem_runtime::RouterHandle,
    task: tokio::task::JoinHandle<Result<(), idem_runtime::Error>>,
) {
    handle.shutdown();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the router stops within 30 s")
        .expect("the router task does not panic")
        .expect("the router returns Ok");
}

fn strings(values: &Value, key: &str) -> Vec<String> {
    let mut found: Vec<String> = values
        .as_array()
        .expect("an array")
        .iter()
        .map(|value| value[key].as_str().expect("a string").to_owned())
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reports_a_known_run_and_replays_its_dead_letters_once() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    // Names of its own, and every dead-letter command scoped to its route's
    // dead-letter subject, so that the test holds on a shared NATS_URL too
    // (the dead-letter stream is shared there).
    let stream = idem_tests::unique_name("CLI_CREDITS");
    let subject = format!("{stream}.credit");
    let dead_subject = format!("idem.dead.{stream}.{DURABLE}");
    let scope = ["--subject", dead_subject.as_str()];

    // `idem migrate` installs the schema the router needs.
    let migrated = idem(&env, &["migrate", "--json"]).await.json(0);
    assert_eq!(
        migrated["version"].as_i64(),
        Some(idem_runtime::schema::latest_version())
    );
    idem(&env, &["verify", "--json"]).await.json(0);
    sqlx::raw_sql(
        "CREATE TABLE accounts (id bigint PRIMARY KEY);
         INSERT INTO accounts VALUES (1), (2);
         CREATE TABLE entries (transfer text NOT NULL, account bigint NOT NULL, amount bigint NOT NULL);",
    )
    .execute(&pool)
    .await
    .unwrap();
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();

    // The known run: 10 credits, 3 of them to the unknown account.
    let dead = transfers([3, 6, 9]);
    for (n, transfer) in transfers(1..=10).iter().enumerate() {
        let account = if dead.contains(transfer) {
            UNKNOWN_ACCOUNT
        } else {
            1 + (n as i64 % 2)
        };
        publish(&js, &subject, transfer, account).await;
    }
    let (handle, task) = start_router(&stream, &subject, nats.clone(), pool.clone());
    wait_settled(&js, &stream).await;
    stop_router(handle.clone(), task).await;
    let stats = handle.stats(DURABLE).expect("the route's stats");
    assert_eq!(
        (stats.dead_lettered(), stats.received()),
        (3, 10),
        "the run did what the test expects"
    );
    // Two more while no worker runs: they are pending.
    publish(&js, &subject, "t-11", 1).await;
    publish(&js, &subject, "t-12", 2).await;

    // `idem status`: the numbers of the run.
    let status = idem(&env, &["status", "--json"]).await.json(0);
    let consumers = status["consumers"].as_array().unwrap();
    // Only routes' consumers are idem consumers: not the advisory consumer
    // each route also binds.
    for consumer in consumers {
        assert_ne!(
            consumer["stream"],
            idem_runtime::dead_letter::ADVISORY_STREAM
        );
        assert!(consumer["handler"].is_string(), "{consumer:#}");
    }
    let ours: Vec<&Value> = consumers
        .iter()
        .filter(|consumer| consumer["stream"] == stream.as_str())
        .collect();
    assert_eq!(ours.len(), 1, "{status:#}");
    let consumer = ours[0];
    assert_eq!(consumer["durable"], DURABLE);
    assert_eq!(consumer["handler"], HANDLER);
    assert_eq!(consumer["pending"], 2);
    assert_eq!(consumer["ack_pending"], 0);
    assert_eq!(consumer["redelivered"], 0);
    assert_eq!(consumer["dead_letters"], 3);
    assert_eq!(consumer["claims"], 7);
    assert_eq!(consumer["dead_letter_subject"], dead_subject.as_str());
    let handlers = status["handlers"].as_array().unwrap();
    assert_eq!(handlers.len(), 1);
    assert_eq!(handlers[0]["name"], HANDLER);
    assert_eq!(handlers[0]["claims"], 7);
    assert_eq!(handlers[0]["retention_seconds"], Value::Null);
    let oldest = handlers[0]["oldest_claim_age_seconds"].as_f64().unwrap();
    assert!((0.0..600.0).contains(&oldest), "oldest claim age {oldest}");
    assert_eq!(status["outbox"]["pending"], 0);
    let durability = &status["database_durability"];
    assert_eq!(durability["synchronous_commit"], "on", "{status:#}");
    assert_eq!(durability["idem_commits_with"], "on", "{status:#}");
    assert_eq!(durability["warnings"], serde_json::json!([]), "{status:#}");
    let text = idem(&env, &["status"]).await;
    assert!(text.text().contains(&format!("{stream}/{DURABLE}")));
    assert!(
        text.text().contains(
            "database durability: synchronous_commit on (idem commits with on), no standby"
        ),
        "{text:#?}"
    );

    // `idem dead-letters list`: the three, with their reasons.
    let listed = idem(
        &env,
        &["dead-letters", "list", "--json", scope[0], scope[1]],
    )
    .await
    .json(0);
    assert_eq!(strings(&listed, "message_id"), dead);
    for letter in listed.as_array().unwrap() {
        assert_eq!(letter["handler"], HANDLER);
        assert_eq!(letter["failure"], "permanent");
        assert_eq!(letter["original_subject"], subject.as_str());
        assert_eq!(letter["delivered"], 1);
        assert_eq!(
            letter["error"],
            format!("the handler failed: account {UNKNOWN_ACCOUNT} does not exist")
        );
    }
    idem(&env, &["dead-letters", "list", scope[0], scope[1]])
        .await
        .text();
    // Dead-lettered in whatever order the route's concurrent slots finished.
    let t03 = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|letter| letter["message_id"] == "t-03")
        .map(|letter| letter["sequence"].to_string())
        .unwrap();

    // Filters select on the server's records, not on the arguments.
    let count = |run: Run| run.json(0).as_array().unwrap().len();
    for (args, expected) in [
        (vec!["--handler", HANDLER], 3),
        (vec!["--handler", "cli.other.v1"], 0),
        (vec!["--failure", "permanent"], 3),
        (vec!["--failure", "exhausted"], 0),
        (vec!["--since", "10m"], 3),
        (vec!["--until", "10m"], 0),
        (vec!["--limit", "1"], 1),
        (vec![], 3),
    ] {
        let mut command = vec!["dead-letters", "list", "--json"];
        command.extend(&args);
        command.extend(scope);
        assert_eq!(count(idem(&env, &command).await), expected, "{args:?}");
    }
    let elsewhere = format!("idem.dead.{stream}_ELSEWHERE.>");
    assert_eq!(
        count(
            idem(
                &env,
                &["dead-letters", "list", "--json", "--subject", &elsewhere]
            )
            .await
        ),
        0
    );

    // `idem dead-letters show`: the payload and every header.
    let shown = idem(&env, &["dead-letters", "show", &t03, "--json"])
        .await
        .json(0);
    let payload: Credit = serde_json::from_str(shown["payload"].as_str().unwrap()).unwrap();
    assert_eq!(
        (payload.transfer.as_str(), payload.account),
        ("t-03", UNKNOWN_ACCOUNT)
    );
    assert_eq!(shown["headers"]["Idem-Failure"][0], "permanent");
    assert_eq!(shown["headers"]["Idem-Message-Id-Source"][0], "key");
    idem(&env, &["dead-letters", "show", &t03]).await.text();

    // Dry runs change nothing: no publish, no delete.
    let before = last_sequence(&js, &stream).await;
    let dry = idem(
        &env,
        &[
            "dead-letters",
            "replay",
            "--all",
            scope[0],
            scope[1],
            "--dry-run",
            "--json",
        ],
    )
    .await
    .json(0);
    assert_eq!(
        (dry["selected"].as_u64(), dry["replayed"].as_u64()),
        (Some(3), Some(3))
    );
    for letter in dry["dead_letters"].as_array().unwrap() {
        assert_eq!(letter["outcome"], "would-replay");
    }
    let dry = idem(
        &env,
        &[
            "dead-letters",
            "discard",
            "--all",
            scope[0],
            scope[1],
            "--dry-run",
        ],
    )
    .await;
    assert!(
        dry.text()
            .contains("3 of 3 would be discarded (dry run: nothing changed)"),
        "{dry:#?}"
    );
    assert_eq!(
        last_sequence(&js, &stream).await,
        before,
        "nothing published"
    );
    assert_eq!(
        count(
            idem(
                &env,
                &["dead-letters", "list", "--json", scope[0], scope[1]]
            )
            .await
        ),
        3,
        "nothing discarded"
    );

    // The cause is fixed; the router runs again; a bulk replay by handler.
    sqlx::query("INSERT INTO accounts VALUES ($1)")
        .bind(UNKNOWN_ACCOUNT)
        .execute(&pool)
        .await
        .unwrap();
    let (handle, task) = start_router(&stream, &subject, nats.clone(), pool.clone());
    // In text, as an operator runs it; what it did is checked on the
    // servers: three messages stored, each credit applied once.
    let replay = idem(
        &env,
        &[
            "dead-letters",
            "replay",
            "--handler",
            HANDLER,
            scope[0],
            scope[1],
        ],
    )
    .await;
    assert!(replay.text().contains("3 of 3 replayed"), "{replay:#?}");
    assert_eq!(last_sequence(&js, &stream).await, before + 3);
    wait_settled(&js, &stream).await;
    let all_once: Vec<(String, i64)> = transfers(1..=12).into_iter().map(|t| (t, 1)).collect();
    assert_eq!(entries(&pool).await, all_once, "every credit applied once");

    // A second bulk replay is refused: JetStream drops each as a duplicate
    // of the first replay, so nothing is published or applied again.
    let again = idem(
        &env,
        &[
            "dead-letters",
            "replay",
            "--all",
            scope[0],
            scope[1],
            "--json",
        ],
    )
    .await;
    assert!(
        again
            .stderr
            .contains("3 of 3 dead letters were not replayed"),
        "{again:#?}"
    );
    let again = again.json(1);
    assert_eq!(again["replayed"], 0);
    assert_eq!(strings(&again["dead_letters"], "message_id"), dead);
    for letter in again["dead_letters"].as_array().unwrap() {
        assert_eq!(letter["outcome"], "refused-duplicate");
    }
    // And once more by sequence, in text.
    let again = idem(&env, &["dead-letters", "replay", &t03]).await;
    assert_eq!(again.code, 1, "{again:#?}");
    assert!(again.stdout.contains("refused-duplicate"), "{again:#?}");
    assert_eq!(
        last_sequence(&js, &stream).await,
        before + 3,
        "the refused replays were not stored"
    );
    wait_settled(&js, &stream).await;
    assert_eq!(entries(&pool).await, all_once, "still applied once each");

    // `replay --discard`: one more credit to an unknown account, fixed,
    // replayed, and its dead letter deleted once the replay is stored.
    publish(&js, &subject, "t-13", 77).await;
    wait_settled(&js, &stream).await;
    let listed = idem(
        &env,
        &["dead-letters", "list", "--json", scope[0], scope[1]],
    )
    .await
    .json(0);
    let t13 = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|letter| letter["message_id"] == "t-13")
        .map(|letter| letter["sequence"].to_string())
        .expect("t-13 is dead-lettered");
    sqlx::query("INSERT INTO accounts VALUES (77)")
        .execute(&pool)
        .await
        .unwrap();
    let replayed = idem(
        &env,
        &["dead-letters", "replay", &t13, "--discard", "--json"],
    )
    .await
    .json(0);
    assert_eq!(replayed["dead_letters"][0]["outcome"], "replayed");
    assert_eq!(replayed["dead_letters"][0]["discarded"], true);
    wait_settled(&js, &stream).await;
    stop_router(handle, task).await;
    let listed = idem(
        &env,
        &["dead-letters", "list", "--json", scope[0], scope[1]],
    )
    .await
    .json(0);
    assert_eq!(
        strings(&listed, "message_id"),
        dead,
        "t-13's dead letter is gone"
    );
    let all_once: Vec<(String, i64)> = transfers(1..=13).into_iter().map(|t| (t, 1)).collect();
    assert_eq!(entries(&pool).await, all_once, "t-13 applied once");

    // `idem dedup check`: processed, and when; or not.
    let checked = idem(&env, &["dedup", "check", HANDLER, "t-03", "--json"])
        .await
        .json(0);
    assert_eq!(checked["processed"], true);
    assert!(checked["claimed_at"].is_string());
    idem(&env, &["dedup", "check", HANDLER, "t-03"])
        .await
        .text();
    let unseen = idem(&env, &["dedup", "check", HANDLER, "t-404", "--json"])
        .await
        .json(0);
    assert_eq!(unseen["processed"], false);
    let typo = idem(&env, &["dedup", "check", "cli.credit.v2", "t-03"]).await;
    assert_eq!(typo.code, 1);
    assert!(
        typo.stderr.contains("no handler named `cli.credit.v2`")
            && typo.stderr.contains("the handlers are: cli.credit.v1"),
        "{typo:#?}"
    );

    // `idem dead-letters discard`: gone; status agrees.
    let discarded = idem(
        &env,
        &[
            "dead-letters",
            "discard",
            "--all",
            scope[0],
            scope[1],
            "--json",
        ],
    )
    .await
    .json(0);
    assert_eq!(discarded["discarded"], 3);
    assert_eq!(strings(&discarded["dead_letters"], "message_id"), dead);
    assert_eq!(
        count(
            idem(
                &env,
                &["dead-letters", "list", "--json", scope[0], scope[1]]
            )
            .await
        ),
        0
    );
    let status = idem(&env, &["status", "--json"]).await.json(0);
    let consumer = status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|consumer| consumer["stream"] == stream.as_str())
        .expect("the route's consumer");
    assert_eq!(consumer["dead_letters"], 0);
    assert_eq!(consumer["pending"], 0);
    assert_eq!(consumer["claims"], 13);
    let gone = idem(&env, &["dead-letters", "show", &t03]).await;
    assert_eq!(gone.code, 1);
    assert!(gone.stderr.contains("discarded or aged out"), "{gone:#?}");
    let gone = idem(&env, &["dead-letters", "replay", &t03, "--json"]).await;
    assert_eq!(gone.json(1)["dead_letters"][0]["outcome"], "not-found");

    // `idem purge` and `idem verify`.
    let purged = idem(&env, &["purge", "--json"]).await.json(0);
    assert_eq!(purged["skipped"], false);
    assert_eq!(purged["retention_seconds"], Value::Null);
    idem(&env, &["purge"]).await.text();
    idem(&env, &["verify"]).await.text();
}

/// Bad command lines exit 2 and say what is wrong; a database without the
/// schema exits 1 and says to migrate.
#[tokio::test]
async fn bad_arguments_exit_non_zero_with_a_clear_message() {
    let env = TestEnv::start().await;
    for (args, expected) in [
        (vec!["dead-letters", "show", "abc"], "invalid value 'abc'"),
        (
            vec!["dead-letters", "list", "--failure", "bogus"],
            "possible values: permanent, exhausted",
        ),
        (
            vec!["dead-letters", "list", "--since", "yesterday-ish"],
            "neither an RFC 3339 time",
        ),
        (vec!["dead-letters", "replay"], "which dead letters?"),
        (
            vec!["dead-letters", "discard", "3", "--handler", "h"],
            "sequences and filters cannot be combined",
        ),
        (
            vec!["dead-letters", "replay", "3", "--all"],
            "cannot be used with",
        ),
        (vec!["dedup", "check", "only-a-handler"], "required"),
        (vec!["frobnicate"], "unrecognized subcommand"),
    ] {
        let run = idem(&env, &args).await;
        assert_eq!(run.code, 2, "{args:?}: {run:#?}");
        assert!(run.stderr.contains(expected), "{args:?}: {run:#?}");
        assert!(run.stdout.is_empty(), "{args:?}: {run:#?}");
    }

    let no_nats = idem_with(None, env.database_url(), &["dead-letters", "list"]).await;
    assert_eq!(no_nats.code, 2, "{no_nats:#?}");
    assert!(
        no_nats.stderr.contains("set NATS_URL or pass --nats-url"),
        "{no_nats:#?}"
    );

    // A fresh database has no schema: verify says to migrate, and so does
    // any command that reads it.
    let pool = env.pool().await;
    let name = idem_tests::unique_name("empty");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&pool)
        .await
        .unwrap();
    let url = env.database_url();
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let (server, _) = path.rsplit_once('/').unwrap();
    let empty = format!("{server}/{name}?{query}");
    for args in [
        ["verify"].as_slice(),
        &["status"],
        &["dedup", "check", "h", "m"],
    ] {
        let run = idem_with(Some(env.nats_url()), &empty, args).await;
        assert_eq!(run.code, 1, "{args:?}: {run:#?}");
        assert!(
            run.stderr.contains("run `idem migrate`"),
            "{args:?}: {run:#?}"
        );
    }
}

/// Registers `name` with `retention` by hand (a router does it at start-up).
async fn register_handler(pool: &PgPool, name: &str, retention: Duration) {
    sqlx::query(
        "INSERT INTO idem_handlers (name, retention)
         VALUES ($1, $2::bigint * interval '1 millisecond')",
    )
    .bind(name)
    .bind(retention.as_millis() as i64)
    .execute(pool)
    .await
    .unwrap();
}

/// `idem purge` and `idem status` say where expiry stands: a transition
/// held by a session that holds a snapshot from before the rotation names
/// it; a purge that fails on a lock names the session that holds it, and
/// `idem status` shows expiry behind with that error until a run succeeds.
#[tokio::test]
async fn purge_and_status_say_what_holds_expiry_back() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    register_handler(&pool, "cli.expiring.v1", Duration::from_secs(2)).await;
    let status = idem(&env, &["status"]).await;
    assert!(
        status
            .text()
            .contains("expiry: retention 2s, 1 generation (current 1), on time"),
        "{status:#?}"
    );

    // A report holding a snapshot across the rotation.
    let mut report = sqlx::PgConnection::connect(env.database_url())
        .await
        .unwrap();
    let report_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut report)
        .await
        .unwrap();
    sqlx::raw_sql(
        "SET application_name = 'nightly-report'; BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM idem_handlers",
    )
    .execute(&mut report)
    .await
    .unwrap();
    sqlx::query("UPDATE idem_generations SET opened_at = now() - interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    let purged = idem(&env, &["purge", "--json"]).await.json(0);
    assert_eq!(purged["rotated_to"], 2, "{purged:#}");
    let waiting = &purged["transition"]["waiting_for"];
    assert!(
        waiting[0]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("pid {report_pid}")),
        "{purged:#}"
    );
    let status = idem(&env, &["status"]).await;
    let text = status.text();
    assert!(
        text.contains("rotation to generation 2 in transition for"),
        "{text}"
    );
    assert!(
        text.contains(&format!("  pid {report_pid} in database"))
            && text.contains("application `nightly-report`")
            && text.contains("holds a snapshot that may predate the rotation"),
        "{text}"
    );
    let json = idem(&env, &["status", "--json"]).await.json(0);
    assert_eq!(
        json["expiry"]["transition"]["waiting_for"][0]["pid"], report_pid,
        "{json:#}"
    );
    sqlx::raw_sql("COMMIT").execute(&mut report).await.unwrap();
    let purged = idem(&env, &["purge", "--json"]).await.json(0);
    assert_eq!(purged["transition_ended"], 2, "{purged:#}");

    // Generation 1 is due; a forgotten session holds its detach.
    sqlx::query("UPDATE idem_generations SET sealed_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    let mut forgotten = sqlx::PgConnection::connect(env.database_url())
        .await
        .unwrap();
    sqlx::raw_sql(
        "SET application_name = 'forgotten-psql'; BEGIN; SELECT count(*) FROM idem_processed",
    )
    .execute(&mut forgotten)
    .await
    .unwrap();
    let failed = idem(&env, &["purge"]).await;
    assert_eq!(failed.code, 1, "{failed:#?}");
    for part in [
        "while detaching generation 1",
        "lock timeout",
        "forgotten-psql",
        "the next run resumes from this step",
    ] {
        assert!(failed.stderr.contains(part), "{part}: {failed:#?}");
    }
    let status = idem(&env, &["status"]).await;
    let text = status.text();
    assert!(
        text.contains("expiry behind: 1 generation due, the oldest sealed 1h")
            && text.contains("retention 2s; last error (1 failed run in a row")
            && text.contains("forgotten-psql"),
        "{text}"
    );
    let json = idem(&env, &["status", "--json"]).await.json(0);
    assert_eq!(json["expiry"]["behind"], true, "{json:#}");
    assert_eq!(json["expiry"]["failures"], 1, "{json:#}");

    sqlx::raw_sql("COMMIT")
        .execute(&mut forgotten)
        .await
        .unwrap();
    let purged = idem(&env, &["purge", "--json"]).await.json(0);
    assert_eq!(purged["expired"], serde_json::json!([1]), "{purged:#}");
    let status = idem(&env, &["status"]).await;
    assert!(status.text().contains("on time; last purge"), "{status:#?}");
}

/// A URL's password or token never reaches stderr: a connect error names
/// the server it tried (host and port), with the credentials replaced by
/// `***`, for NATS (user and password, or a token) and PostgreSQL alike.
#[tokio::test]
async fn credentials_in_urls_never_appear_in_errors() {
    // A port nothing listens on: connections are refused at once.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let server = format!("127.0.0.1:{closed}");
    let secret = "s3cret-pass";
    let database = format!("postgres://alice:{secret}@{server}/ledger");
    for nats in [
        format!("nats://alice:{secret}@{server}"),
        format!("nats://{secret}@{server}"),
        format!("nats://127.0.0.1:1,nats://bob:{secret}@{server}"),
    ] {
        let run = idem_with(Some(&nats), &database, &["dead-letters", "list"]).await;
        assert_eq!(run.code, 1, "{run:#?}");
        assert!(run.stderr.contains(&server), "names the server: {run:#?}");
        assert!(!run.stderr.contains(secret), "no secret: {run:#?}");
        assert!(run.stderr.contains("***"), "says it hid one: {run:#?}");
    }
    for database in [
        database.clone(),
        format!("postgres://{server}/ledger?user=alice&password={secret}"),
    ] {
        let run = idem_with(None, &database, &["verify"]).await;
        assert_eq!(run.code, 1, "{run:#?}");
        assert!(run.stderr.contains(&server), "names the server: {run:#?}");
        assert!(!run.stderr.contains(secret), "no secret: {run:#?}");
        assert!(run.stderr.contains("***"), "says it hid one: {run:#?}");
    }
    // A URL that does not parse is not echoed with its password either.
    let run = idem_with(
        None,
        &format!("postgres://alice:{secret}@[::1/x"),
        &["verify"],
    )
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(!run.stderr.contains(secret), "no secret: {run:#?}");
}
