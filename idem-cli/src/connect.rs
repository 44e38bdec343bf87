//! Connections to NATS and PostgreSQL, each made only by the commands that
//! need it, with errors that say which setting to check.

use std::time::Duration;

use async_nats::jetstream;
use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use crate::output::CliError;

/// How long a connection attempt may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A JetStream context on the server at `url`.
pub async fn nats(url: Option<&str>) -> Result<jetstream::Context, CliError> {
    let url = url.ok_or_else(|| {
        CliError::usage(
            "this command needs NATS, and no server was given",
            "set NATS_URL or pass --nats-url nats://HOST:4222",
        )
    })?;
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(CONNECT_TIMEOUT)
        .connect(url)
        .await
        .map_err(|error| {
            CliError::new(
                format!("cannot connect to NATS at {url}: {error}"),
                "check that nats-server runs there and that NATS_URL (or --nats-url) names it",
            )
        })?;
    Ok(jetstream::new(client))
}

/// A small pool on the database at `url`, after one connection proved it
/// reachable (so that a failure shows the real cause, not a pool timeout).
pub async fn database(url: Option<&str>) -> Result<PgPool, CliError> {
    let url = url.ok_or_else(|| {
        CliError::usage(
            "this command needs the database, and none was given",
            "set DATABASE_URL or pass --database-url postgres://USER@HOST/DB",
        )
    })?;
    // The URL may hold a password: errors never print it.
    let options = PgConnectOptions::from_str(url).map_err(|error| {
        CliError::usage(
            format!("the database URL does not parse: {error}"),
            "DATABASE_URL (or --database-url) must look like postgres://USER[:PASSWORD]@HOST[:PORT]/DB",
        )
    })?;
    let unreachable = |cause: String| {
        CliError::new(
            format!("cannot connect to the database: {cause}"),
            "check that PostgreSQL runs and that DATABASE_URL (or --database-url) is right",
        )
    };
    // A timeout around a connection attempt, never around a transaction.
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|error| unreachable(error.to_string()))?;
    let _ = probe.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options))
}

/// The dedup schema must be there before anything reads it.
pub async fn verified_database(url: Option<&str>) -> Result<PgPool, CliError> {
    let pool = database(url).await?;
    crate::maintenance::verify_schema(&pool).await?;
    Ok(pool)
}
