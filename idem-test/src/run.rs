//! A run: the user's routers under the kit's faults, from start-up to the
//! moment nothing is left to do.
//!
//! [`Run::until_settled`] takes these steps, each in a function below:
//!
//! 1. **Launch** every router with the plan's hooks, its routes tuned
//!    (short ack_wait and backoff; heartbeats off for
//!    [`Fault::RedeliveryDuringAttempt`]), on a NATS client of its own and
//!    a pool through the COMMIT-cutting proxy; wait until every route's
//!    consumer exists.
//! 2. **Prepare** the streams: shorten duplicate windows to 1 s where a
//!    fault must outlast one, and capture subjects no stream stores.
//! 3. **Drive** (`drive.rs`): publish in segments, restart the servers
//!    between them, republish after the window, send the requests.
//! 4. **Settle** (`settle.rs`): replay the dead letters of
//!    [`Fault::DeadLetterReplay`] as they appear, and wait until every
//!    consumer, the outbox and the journal stand still and empty.
//! 5. **Stop** the routers, and **check** that every fault happened.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_runtime::fault::FaultHooks;
use idem_runtime::{Route, Router, RouterHandle};
use serde::Serialize;
use tokio::task::JoinHandle;

use crate::bed::Bed;
use crate::faults::{Fault, Faults};
use crate::harness::PgProxy;
use crate::harness::pg_proxy::upstream_of;
use crate::plan::Plan;
use crate::report::{Happened, RunReport};
use crate::settled::Settled;

/// The duplicate window a run gives the streams its faults must outlast a
/// window of.
pub(crate) const SHORT_WINDOW: Duration = Duration::from_secs(1);

/// One message to publish.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) subject: String,
    pub(crate) id: String,
    pub(crate) payload: bytes::Bytes,
}

type Launch = Box<dyn FnOnce(Wiring) -> Launched + Send>;

/// What the kit hands each router it launches.
struct Wiring {
    hooks: FaultHooks,
    tune: Arc<dyn Fn(Route) -> Route + Send + Sync>,
    nats: async_nats::Client,
    pool: sqlx::PgPool,
}

/// A router the kit launched.
pub(crate) struct Launched {
    /// Its JetStream routes: (stream, durable).
    pub(crate) routes: Vec<(String, String)>,
    pub(crate) handle: RouterHandle,
    pub(crate) task: JoinHandle<Result<(), idem_runtime::Error>>,
}

/// The NATS connection events the routers' clients saw.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    pub(crate) disconnects: AtomicUsize,
    pub(crate) connects: AtomicUsize,
}

/// A run of your routers under faults: what to publish, which faults to
/// inject, and how long to wait. Made by [`Bed::run`]; consumed by
/// [`Run::until_settled`], which returns the [`Settled`] state to assert on.
///
/// ```no_run
/// # use idem_runtime::{Route, Router, idempotent};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Credit { id: u32 }
/// # #[idempotent(name = "credit.v1", key = c.id)]
/// # async fn credit(tx: &mut sqlx::PgTransaction<'_>, c: Credit) -> Result<(), sqlx::Error> { Ok(()) }
/// # async fn demo(bed: idem_test::Bed) {
/// use std::time::Duration;
/// use idem_test::{Fault, Faults};
///
/// let router = Router::new().route(Route::new("LEDGER", "credit"), credit);
/// bed.run(router)
///     .publish_json("ledger.credit", (0..50).map(|id| Credit { id }))
///     .with_faults(Faults::none().with(Fault::CrashBeforeAck).with(Fault::HandlerFailure))
///     .timeout(Duration::from_secs(60))
///     .until_settled()
///     .await
///     .assert_claims("credit.v1", 50)
///     .assert_no_dead_letters();
/// # }
/// ```
pub struct Run<'b> {
    bed: &'b Bed,
    routers: Vec<Launch>,
    messages: Vec<Message>,
    requests: Vec<Message>,
    captures: Vec<String>,
    faults: Faults,
    timeout: Duration,
    ack_wait: Duration,
    next_id: usize,
}

impl<'b> Run<'b> {
    pub(crate) fn new(bed: &'b Bed) -> Run<'b> {
        Run {
            bed,
            routers: Vec::new(),
            messages: Vec::new(),
            requests: Vec::new(),
            captures: Vec::new(),
            faults: Faults::none(),
            timeout: Duration::from_secs(120),
            ack_wait: Duration::from_secs(2),
            next_id: 0,
        }
    }

    /// Runs `router` too: another service of a pipeline, say. Each router
    /// gets a NATS client and a database pool of its own, as a process
    /// would. Its fault hooks are the run's (hooks it had are replaced).
    pub fn router<S: Send + Sync + 'static>(mut self, router: Router<S>) -> Run<'b> {
        self.routers.push(Box::new(move |wiring: Wiring| {
            let mut routes = Vec::new();
            let tune = wiring.tune.clone();
            let router = router
                .tune_routes(|route| {
                    routes.push((
                        route.stream_name().to_owned(),
                        route.durable_name().to_owned(),
                    ));
                    tune(route)
                })
                .fault_hooks(wiring.hooks);
            let handle = router.handle();
            let task =
                tokio::spawn(router.run_until(wiring.nats, wiring.pool, std::future::pending()));
            Launched {
                routes,
                handle,
                task,
            }
        }));
        self
    }

    /// Publishes each item, encoded as JSON, to `subject` with JetStream,
    /// each with a `Nats-Msg-Id` of its own (`<subject>#<n>`), as a
    /// publisher that retries would set.
    ///
    /// # Panics
    ///
    /// If an item does not encode.
    pub fn publish_json<T: Serialize>(
        mut self,
        subject: &str,
        items: impl IntoIterator<Item = T>,
    ) -> Run<'b> {
        for item in items {
            let message = self.numbered(subject, &item);
            self.messages.push(message);
        }
        self
    }

    /// Publishes each `(id, item)`, encoded as JSON, to `subject` with
    /// `id` as its `Nats-Msg-Id`.
    ///
    /// # Panics
    ///
    /// If an item does not encode.
    pub fn publish_json_with_ids<T: Serialize>(
        mut self,
        subject: &str,
        items: impl IntoIterator<Item = (String, T)>,
    ) -> Run<'b> {
        for (id, item) in items {
            self.messages.push(Message {
                subject: subject.to_owned(),
                id,
                payload: encode(&item),
            });
        }
        self
    }

    /// Sends each item, encoded as JSON, as a core NATS request to
    /// `subject` (a [`ReplyRoute`](idem_runtime::ReplyRoute)'s), with a
    /// `Nats-Msg-Id` of its own, as a client that retries would: again
    /// with the same id while it gets no answer or an `Idem-Error: retry`
    /// one, and once more after its first answer. See
    /// [`Settled::assert_replies_identical`].
    ///
    /// # Panics
    ///
    /// If an item does not encode.
    pub fn request_json<T: Serialize>(
        mut self,
        subject: &str,
        items: impl IntoIterator<Item = T>,
    ) -> Run<'b> {
        for item in items {
            let request = self.numbered(subject, &item);
            self.requests.push(request);
        }
        self
    }

    /// `item` as the run's next message to `subject`, with an id of its
    /// own (`<subject>#<n>`).
    fn numbered<T: Serialize>(&mut self, subject: &str, item: &T) -> Message {
        let id = format!("{subject}#{}", self.next_id);
        self.next_id += 1;
        Message {
            subject: subject.to_owned(),
            id,
            payload: encode(item),
        }
    }

    /// Keeps every message published to `subject` (a wildcard may be
    /// used), so that [`Settled::assert_published_once`] can count them:
    /// if no stream stores the subject, the run creates one that does
    /// before the routers take any message.
    pub fn capture(mut self, subject: &str) -> Run<'b> {
        self.captures.push(subject.to_owned());
        self
    }

    /// The faults to inject (none by default).
    pub fn with_faults(mut self, faults: impl Into<Faults>) -> Run<'b> {
        self.faults = faults.into();
        self
    }

    /// How long [`until_settled`](Run::until_settled) waits for the run to
    /// settle (default 120 s) before it fails, reporting what is still
    /// pending.
    pub fn timeout(mut self, timeout: Duration) -> Run<'b> {
        self.timeout = timeout;
        self
    }

    /// The ack_wait the run gives every route (default 2 s): how long a
    /// message dropped after COMMIT waits for its redelivery.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Run<'b> {
        self.ack_wait = ack_wait;
        self
    }

    /// Launches the routers, publishes, injects the faults, and waits until
    /// nothing is left to do: every consumer has nothing pending or
    /// awaiting ack, the outbox is empty, every request is answered, and
    /// nothing moves between two looks. Then stops the routers and checks
    /// that each fault happened.
    ///
    /// Every route is changed for the run: ack_wait as set by
    /// [`Run::ack_wait`], retries after 50 ms (up to 1 s), and, with
    /// [`Fault::RedeliveryDuringAttempt`], no heartbeats.
    ///
    /// # Panics
    ///
    /// If a router fails to start or stops by itself, if the run does not
    /// settle within its timeout, or if a fault did not happen; each
    /// message says what was pending or missing, and which faults ran.
    pub async fn until_settled(mut self) -> Settled<'b> {
        let started = Instant::now();
        self.refuse_what_cannot_run();
        let routers = std::mem::take(&mut self.routers);
        let proxy = Arc::new(PgProxy::start(upstream_of(self.bed.database_url())).await);
        let plan = Plan::new(
            self.faults.clone(),
            proxy.clone(),
            self.bed.pool(),
            self.ack_wait * 3 + Duration::from_secs(10),
            self.copied_late(),
        );
        let happened = Arc::new(Mutex::new(Happened::default()));
        let connections = Arc::new(Connections::default());
        let launched = self.launch(routers, &plan, &proxy, &connections).await;
        let routes: Vec<(String, String)> = launched
            .iter()
            .flat_map(|router| router.routes.clone())
            .collect();
        let js = self.bed.jetstream();
        crate::settle::wait_for_start_up(&js, &routes, &launched, self.timeout).await;
        self.prepare_streams(&js, &routes, &happened).await;

        let deadline = started + self.timeout;
        let driving = crate::drive::Driver {
            bed: self.bed,
            js: js.clone(),
            plan: plan.clone(),
            faults: self.faults.clone(),
            messages: self.messages.clone(),
            requests: self.requests.clone(),
            happened: happened.clone(),
            connections: connections.clone(),
            deadline,
        }
        .drive();
        let settling = crate::settle::Settler {
            bed: self.bed,
            js: js.clone(),
            plan: plan.clone(),
            routes: routes.clone(),
            launched: &launched,
            happened: happened.clone(),
            deadline,
        };
        settling.until_settled(driving).await;
        let mut subjects: Vec<String> = self.requests.iter().map(|r| r.subject.clone()).collect();
        subjects.sort_unstable();
        subjects.dedup();
        let stats = crate::settle::stop(launched, &subjects).await;

        let report = RunReport::new(
            &self.faults,
            &plan,
            &happened.lock().unwrap(),
            &connections,
            stats,
            started.elapsed(),
        );
        report.check_every_fault_happened();
        Settled::new(self.bed, report, routes, self.captures)
    }

    /// The ids of the messages duplicate-after-window publishes again: the
    /// first of the run's messages, as many as each fault takes
    /// (`drive.rs`).
    fn copied_late(&self) -> std::collections::HashSet<String> {
        if !self.faults.contains(Fault::DuplicateAfterWindow) {
            return std::collections::HashSet::new();
        }
        self.messages
            .iter()
            .take(self.faults.each())
            .map(|message| message.id.clone())
            .collect()
    }

    /// Fails at once on what a run cannot do here.
    fn refuse_what_cannot_run(&self) {
        assert!(
            !self.routers.is_empty(),
            "idem-test: a run needs a router: Bed::run(router)"
        );
        for (fault, var) in [
            (Fault::PostgresRestart, "DATABASE_URL"),
            (Fault::NatsRestart, "NATS_URL"),
        ] {
            if self.faults.contains(fault) && std::env::var_os(var).is_some() {
                panic!(
                    "idem-test: fault {fault} restarts a server, so it needs one of the kit's \
                     own, but {var} is set; unset it, or leave the fault out \
                     (Faults::all().without(Fault::{fault:?}))"
                );
            }
        }
    }

    /// Step 1: every router, with the plan's hooks and tuned routes, on a
    /// client and a pool of its own.
    async fn launch(
        &self,
        routers: Vec<Launch>,
        plan: &Arc<Plan>,
        proxy: &PgProxy,
        connections: &Arc<Connections>,
    ) -> Vec<Launched> {
        let ack_wait = self.ack_wait;
        let quiet = self.faults.contains(Fault::RedeliveryDuringAttempt);
        let tune: Arc<dyn Fn(Route) -> Route + Send + Sync> = Arc::new(move |route: Route| {
            let route = route
                .ack_wait(ack_wait)
                .backoff(Duration::from_millis(50), Duration::from_secs(1));
            if quiet {
                route.without_heartbeat().allow_redelivery_while_running()
            } else {
                route
            }
        });
        let mut launched = Vec::new();
        for launch in routers {
            let events = connections.clone();
            let nats = async_nats::ConnectOptions::new()
                .event_callback(move |event| {
                    match event {
                        async_nats::Event::Disconnected => {
                            events.disconnects.fetch_add(1, Ordering::SeqCst);
                        }
                        async_nats::Event::Connected => {
                            events.connects.fetch_add(1, Ordering::SeqCst);
                        }
                        _ => {}
                    }
                    std::future::ready(())
                })
                .connect(self.bed.nats_url())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "idem-test: cannot connect a router to NATS at {}: {e}",
                        self.bed.nats_url()
                    )
                });
            let pool = Bed::router_pool(&proxy.url_for(self.bed.database_url()));
            launched.push(launch(Wiring {
                hooks: plan.hooks(),
                tune: tune.clone(),
                nats,
                pool,
            }));
        }
        launched
    }

    /// Step 2: duplicate windows a fault must outlast, and captures.
    async fn prepare_streams(
        &self,
        js: &jetstream::Context,
        routes: &[(String, String)],
        happened: &Mutex<Happened>,
    ) {
        if self.faults.contains(Fault::DuplicateAfterWindow)
            || self.faults.contains(Fault::DeadLetterReplay)
        {
            let mut streams: Vec<&str> = routes.iter().map(|(stream, _)| stream.as_str()).collect();
            streams.sort_unstable();
            streams.dedup();
            for name in streams {
                let mut stream = js
                    .get_stream(name)
                    .await
                    .unwrap_or_else(|e| panic!("idem-test: cannot read stream {name}: {e}"));
                let mut config = stream
                    .info()
                    .await
                    .unwrap_or_else(|e| panic!("idem-test: cannot read stream {name}: {e}"))
                    .config
                    .clone();
                if config.duplicate_window > SHORT_WINDOW {
                    let was = config.duplicate_window;
                    config.duplicate_window = SHORT_WINDOW;
                    js.update_stream(config).await.unwrap_or_else(|e| {
                        panic!("idem-test: cannot shorten the duplicate window of {name}: {e}")
                    });
                    happened.lock().unwrap().notes.push(format!(
                        "stream {name}: duplicate window shortened from {was:?} to {SHORT_WINDOW:?}"
                    ));
                }
            }
        }
        for (n, subject) in self.captures.iter().enumerate() {
            if js.stream_by_subject(subject.clone()).await.is_ok() {
                continue;
            }
            let name = format!("IDEM_TEST_CAPTURE_{n}");
            js.create_stream(jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| {
                panic!("idem-test: cannot create stream {name} to capture {subject}: {e}")
            });
        }
    }
}

fn encode<T: Serialize>(item: &T) -> bytes::Bytes {
    serde_json::to_vec(item)
        .unwrap_or_else(|e| panic!("idem-test: an item does not encode as JSON: {e}"))
        .into()
}
