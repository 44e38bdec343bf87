//! The example pipeline's services, for `tests/tests/observe/metrics.rs`:
//! `pipeline_service orders` or `pipeline_service payments` runs exactly what
//! the `orders` and `payments` binaries of `examples/pipeline` run
//! ([`pipeline_example::run`]). It exists because cargo builds a test's
//! binaries only from the test's own package.

use pipeline_example::Service;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let service = match std::env::args().nth(1).as_deref() {
        Some("orders") => Service::Orders,
        Some("payments") => Service::Payments,
        other => {
            return Err(format!("usage: pipeline_service orders|payments (got {other:?})").into());
        }
    };
    pipeline_example::run(service).await
}
