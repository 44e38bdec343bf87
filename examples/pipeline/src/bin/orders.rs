//! The orders service: `NATS_URL=.. DATABASE_URL=.. orders`, until SIGINT or
//! SIGTERM; `IDEM_METRICS_ADDR=host:port` serves `/metrics`. See the library
//! docs for the pipeline it belongs to.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    pipeline_example::run(pipeline_example::Service::Orders).await
}
