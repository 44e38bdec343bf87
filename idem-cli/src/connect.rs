//! Connections to NATS and PostgreSQL, each made only by the commands that
//! need it, with errors that say which setting to check.
//!
//! A URL may hold credentials (`nats://user:password@host`, a NATS token
//! `nats://token@host`, `postgres://user:password@host/db`, or
//! `?password=...`). Errors name the server they tried with [`redact`],
//! which replaces them with `***`, and pass through [`scrub`], which removes
//! them from the text of the client's own error too.

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
                scrub(
                    &format!("cannot connect to NATS at {}: {error}", redact(url)),
                    url,
                ),
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
            scrub(&format!("the database URL does not parse: {error}"), url),
            "DATABASE_URL (or --database-url) must look like postgres://USER[:PASSWORD]@HOST[:PORT]/DB",
        )
    })?;
    let unreachable = |cause: String| {
        CliError::new(
            scrub(
                &format!("cannot connect to the database at {}: {cause}", redact(url)),
                url,
            ),
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

/// Query parameters whose value is a secret.
const SECRET_PARAMETERS: &[&str] = &["password", "sslpassword", "pass", "token", "jwt", "nkey"];

/// `url` with every password and token replaced by `***`, so that it can be
/// shown: `nats://alice:***@host:4222`, `nats://***@host` (a NATS token),
/// `postgres://alice:***@host/db`, `...?password=***`. A NATS server list
/// (comma-separated) is redacted entry by entry.
pub fn redact(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let parts = Parts::of(one);
            let mut shown = String::new();
            if let Some(scheme) = parts.scheme {
                shown.push_str(scheme);
                shown.push_str("://");
            }
            if let Some(userinfo) = parts.userinfo {
                match userinfo.split_once(':') {
                    Some((user, _)) => shown.push_str(&format!("{user}:***@")),
                    // A user name alone is no secret in a database URL; in
                    // a NATS URL it is a token.
                    None if parts.is_postgres() => shown.push_str(&format!("{userinfo}@")),
                    None => shown.push_str("***@"),
                }
            }
            shown.push_str(parts.host);
            shown.push_str(parts.path);
            if let Some(query) = parts.query {
                let query: Vec<String> = query
                    .split('&')
                    .map(|pair| match pair.split_once('=') {
                        Some((key, _)) if is_secret_parameter(key) => format!("{key}=***"),
                        _ => pair.to_owned(),
                    })
                    .collect();
                shown.push('?');
                shown.push_str(&query.join("&"));
            }
            shown
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `text` with every secret of `url` (see [`redact`]) replaced by `***`,
/// as written and percent-decoded: for error texts of the clients, which
/// may quote what they were given.
pub fn scrub(text: &str, url: &str) -> String {
    let mut secrets = Vec::new();
    for one in url.split(',') {
        let parts = Parts::of(one);
        match parts.userinfo.map(|userinfo| userinfo.split_once(':')) {
            Some(Some((_, password))) => secrets.push(password),
            Some(None) if !parts.is_postgres() => secrets.extend(parts.userinfo),
            _ => {}
        }
        for pair in parts.query.into_iter().flat_map(|query| query.split('&')) {
            if let Some((key, value)) = pair.split_once('=')
                && is_secret_parameter(key)
            {
                secrets.push(value);
            }
        }
    }
    let mut scrubbed = text.to_owned();
    for secret in secrets.into_iter().filter(|secret| !secret.is_empty()) {
        scrubbed = scrubbed.replace(secret, "***");
        let decoded = percent_decode(secret);
        if !decoded.is_empty() {
            scrubbed = scrubbed.replace(&decoded, "***");
        }
    }
    scrubbed
}

fn is_secret_parameter(key: &str) -> bool {
    SECRET_PARAMETERS
        .iter()
        .any(|secret| key.eq_ignore_ascii_case(secret))
}

/// A URL cut into what [`redact`] needs, without decoding anything.
struct Parts<'a> {
    scheme: Option<&'a str>,
    userinfo: Option<&'a str>,
    host: &'a str,
    path: &'a str,
    query: Option<&'a str>,
}

impl<'a> Parts<'a> {
    fn of(url: &'a str) -> Parts<'a> {
        let (scheme, rest) = match url.split_once("://") {
            Some((scheme, rest)) => (Some(scheme), rest),
            None => (None, url),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        // The authority ends at the path; its userinfo at its last `@`.
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (userinfo, host) = match authority.rsplit_once('@') {
            Some((userinfo, host)) => (Some(userinfo), host),
            None => (None, authority),
        };
        Parts {
            scheme,
            userinfo,
            host,
            path,
            query,
        }
    }

    fn is_postgres(&self) -> bool {
        matches!(self.scheme, Some("postgres" | "postgresql"))
    }
}

/// `%XX` escapes decoded (lossily), as a client shows a decoded password.
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                decoded.push(byte);
                i += 3;
            }
            (byte, _) => {
                decoded.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted_and_the_server_kept() {
        for (url, shown) in [
            ("nats://alice:pw@h:4222", "nats://alice:***@h:4222"),
            ("nats://tok3n@h:4222", "nats://***@h:4222"),
            ("tls://a:b@h,nats://t@g:1", "tls://a:***@h,nats://***@g:1"),
            ("alice:pw@h:4222", "alice:***@h:4222"),
            ("nats://h:4222", "nats://h:4222"),
            (
                "postgres://alice:p%40ss@h:5432/db",
                "postgres://alice:***@h:5432/db",
            ),
            ("postgres://alice@h/db", "postgres://alice@h/db"),
            (
                "postgres://h/db?user=alice&password=pw&sslmode=require",
                "postgres://h/db?user=alice&password=***&sslmode=require",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
    }

    #[test]
    fn secrets_are_scrubbed_from_any_text_as_written_and_decoded() {
        let url = "postgres://alice:p%40ss@h/db?sslpassword=k3y";
        assert_eq!(scrub("p%40ss, p@ss and k3y", url), "***, *** and ***");
        assert_eq!(scrub("token tok3n", "nats://tok3n@h"), "token ***");
        // A user name alone stays in a database URL.
        assert_eq!(scrub("role alice", "postgres://alice@h/db"), "role alice");
    }
}
