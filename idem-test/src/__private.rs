//! What `#[idem_test::test]` expands to calls. Not a public API: its shape
//! may change in any release.

use std::future::Future;
use std::pin::Pin;

use crate::Bed;

type SetupFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// How a test is set up.
#[derive(Default)]
pub struct Options {
    setup: Option<Box<dyn FnOnce(sqlx::PgPool) -> SetupFuture>>,
}

impl Options {
    /// No set-up beyond idem's schema.
    pub fn new() -> Options {
        Options::default()
    }

    /// Runs `setup` on the test database first.
    pub fn setup(mut self, setup: impl FnOnce(sqlx::PgPool) -> SetupFuture + 'static) -> Options {
        self.setup = Some(Box::new(setup));
        self
    }
}

/// What a set-up fn may return: `()` or a `Result` whose error is shown.
pub trait SetupResult {
    /// The error's text, if it failed.
    fn into_setup_result(self) -> Result<(), String>;
}

impl SetupResult for () {
    fn into_setup_result(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: std::fmt::Debug> SetupResult for Result<(), E> {
    fn into_setup_result(self) -> Result<(), String> {
        self.map_err(|e| format!("{e:?}"))
    }
}

/// Runs one test: a multi-thread runtime, a [`Bed`], the set-up, the body.
pub fn run<F, Fut>(options: Options, test: F) -> Fut::Output
where
    F: FnOnce(Bed) -> Fut,
    Fut: Future,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("idem-test: cannot build a tokio runtime for the test");
    runtime.block_on(async move {
        let bed = Bed::start().await;
        if let Some(setup) = options.setup
            && let Err(error) = setup(bed.pool()).await
        {
            panic!("idem-test: the test's setup failed: {error}");
        }
        test(bed).await
    })
}
