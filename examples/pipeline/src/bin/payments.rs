//! The payments service: `NATS_URL=.. DATABASE_URL=.. payments`, until SIGINT
//! or SIGTERM. See the library docs for the pipeline it belongs to.

use pipeline_example::{connect, payments, serve};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (nats, pool) = connect().await?;
    payments::migrate(&pool).await?;
    serve(payments::router(), nats, pool).await
}
