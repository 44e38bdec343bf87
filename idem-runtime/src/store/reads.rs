//! What operators read of the dedup tables (for [`status`](crate::status)
//! and the warnings of start-up): the handlers and their claims, one
//! message's claim, and when a name was last registered.

use sqlx::PgPool;

/// A handler and its claims: name, retention (seconds), claims, and the
/// oldest claim's time and age (seconds).
pub(crate) type HandlerRow = (String, Option<f64>, i64, Option<f64>, Option<f64>);

/// Every handler registered in the dedup schema, by name, with its claims
/// (a scan of the claims table).
pub(crate) async fn handlers(pool: &PgPool) -> Result<Vec<HandlerRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT h.name,
                extract(epoch FROM h.retention)::float8,
                count(p.key),
                extract(epoch FROM min(p.claimed_at))::float8,
                extract(epoch FROM now() - min(p.claimed_at))::float8
           FROM idem_handlers h LEFT JOIN idem_processed p ON p.handler = h.name
          GROUP BY h.name, h.retention
          ORDER BY h.name",
    )
    .fetch_all(pool)
    .await
}

/// The committed claim on `key`, if any: when it was made (Unix seconds),
/// its age (seconds), its generation, and whether a result is stored with
/// it.
pub(crate) async fn claim(
    pool: &PgPool,
    key: &str,
) -> Result<Option<(f64, f64, i32, bool)>, sqlx::Error> {
    // A claim made during a generation transition is in two generations:
    // the first row is the one it was made with.
    sqlx::query_as(
        "SELECT extract(epoch FROM claimed_at)::float8,
                extract(epoch FROM now() - claimed_at)::float8,
                gen, result IS NOT NULL
           FROM idem_claims WHERE key = $1::uuid
          ORDER BY claimed_at, gen LIMIT 1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
}

/// The names of the handlers registered in the dedup schema, sorted.
pub(crate) async fn handler_names(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM idem_handlers ORDER BY name")
        .fetch_all(pool)
        .await
}

/// When `name` was last registered in `idem_handlers`, as the database
/// writes the time (`None` if it never was).
pub(crate) async fn registered_at(
    pool: &PgPool,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT to_char(updated_at, 'YYYY-MM-DD HH24:MI:SS TZ') FROM idem_handlers WHERE name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
}
