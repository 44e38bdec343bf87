//! The orders service: `NATS_URL=.. DATABASE_URL=.. orders`, until SIGINT or
//! SIGTERM. See the library docs for the pipeline it belongs to.

use pipeline_example::{connect, orders, serve};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (nats, pool) = connect().await?;
    orders::migrate(&pool).await?;
    serve(orders::router(), nats, pool).await
}
