//! Connections to NATS and the database, each made only by the commands
//! that need it, with errors that say which setting to check.
//!
//! The database URL's scheme chooses the database ([`Database`]):
//! `postgres://` or `postgresql://` is PostgreSQL, `sqlite:` a SQLite file
//! on this machine, `mysql://` or `mariadb://` MariaDB. A SQLite file is never created, except by `idem
//! migrate` when the URL asks for it (`?mode=rwc`): a mistyped path fails
//! instead of reading an empty database.
//!
//! A URL may hold credentials (`nats://user:password@host`, a NATS token
//! `nats://token@host`, `postgres://user:password@host/db`, or
//! `?password=...`). Errors name the server they tried with [`redact`],
//! which replaces them with `***`, and pass through [`scrub`], which removes
//! them from the text of the client's own error too.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Connection, MySqlPool, PgPool, SqliteConnection, SqlitePool};

use crate::output::CliError;

/// How long a connection attempt may take before the command gives up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What `--database-url` may name, for the hints.
const SUPPORTED: &str = "DATABASE_URL (or --database-url) must name PostgreSQL \
    (postgres://USER[:PASSWORD]@HOST[:PORT]/DB, or postgresql://...), a SQLite file \
    (sqlite:///ABSOLUTE/PATH.db, sqlite://RELATIVE/PATH.db) or MariaDB \
    (mysql://USER[:PASSWORD]@HOST[:PORT]/DB, or mariadb://...)";

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

/// The database a command works on, as the URL's scheme chose it.
pub enum Database {
    /// PostgreSQL (`postgres://`, `postgresql://`).
    Postgres(PgPool),
    /// A SQLite file on this machine (`sqlite:`).
    Sqlite(SqlitePool),
    /// MariaDB (`mysql://`, `mariadb://`).
    Mariadb(MySqlPool),
}

/// Runs `$body` with `$pool` bound to the pool of either database: for the
/// runtime's functions that are generic over it (`status::handlers`,
/// `schema::verify`, `expiry::purge`, ...), called once for both.
macro_rules! with_pool {
    ($database:expr, $pool:ident => $body:expr) => {
        match $database {
            $crate::connect::Database::Postgres($pool) => $body,
            $crate::connect::Database::Sqlite($pool) => $body,
            $crate::connect::Database::Mariadb($pool) => $body,
        }
    };
}
pub(crate) use with_pool;

/// Which database a URL names, by its scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Postgres,
    Sqlite,
    Mariadb,
}

/// Whether a missing SQLite file may be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// Never: every command but `idem migrate`.
    Never,
    /// When the URL asks for it (`?mode=rwc`): `idem migrate`.
    IfTheUrlAsks,
}

/// The database at `url`, after one connection proved it reachable (so
/// that a failure shows the real cause, not a pool timeout).
pub async fn database(url: Option<&str>, create: Create) -> Result<Database, CliError> {
    let url = url.ok_or_else(|| {
        CliError::usage(
            "this command needs the database, and none was given",
            "set DATABASE_URL or pass --database-url postgres://USER@HOST/DB (or sqlite:///PATH/TO/FILE.db)",
        )
    })?;
    match scheme(url)? {
        Scheme::Postgres => postgres(url).await.map(Database::Postgres),
        Scheme::Sqlite => sqlite(url, create).await.map(Database::Sqlite),
        Scheme::Mariadb => mariadb(url).await.map(Database::Mariadb),
    }
}

/// The dedup schema must be there before anything reads it.
pub async fn verified_database(url: Option<&str>) -> Result<Database, CliError> {
    let database = database(url, Create::Never).await?;
    crate::maintenance::verify_schema(&database).await?;
    Ok(database)
}

/// The database `url`'s scheme names; a usage error for any other.
fn scheme(url: &str) -> Result<Scheme, CliError> {
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => Ok(Scheme::Postgres),
        Some("sqlite") => Ok(Scheme::Sqlite),
        Some("mysql" | "mariadb") => Ok(Scheme::Mariadb),
        _ => Err(CliError::usage(
            format!(
                "the database URL {} does not start with a scheme idem supports (postgres://, postgresql://, sqlite:, mysql:// or mariadb://)",
                redact(url)
            ),
            SUPPORTED,
        )),
    }
}

/// A small pool on the PostgreSQL database at `url`.
async fn postgres(url: &str) -> Result<PgPool, CliError> {
    // The URL may hold a password: errors never print it.
    let options = PgConnectOptions::from_str(url).map_err(|error| {
        CliError::usage(
            scrub(&format!("the database URL does not parse: {error}"), url),
            "DATABASE_URL (or --database-url) must look like postgres://USER[:PASSWORD]@HOST[:PORT]/DB",
        )
    })?;
    server_pool::<sqlx::Postgres>(url, options, "PostgreSQL").await
}

/// A small pool on the MariaDB database at `url` (`mariadb://` is read as
/// `mysql://`, which sqlx takes).
async fn mariadb(url: &str) -> Result<MySqlPool, CliError> {
    let spelled = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("mariadb") => {
            format!("mysql://{rest}")
        }
        _ => url.to_owned(),
    };
    let options = MySqlConnectOptions::from_str(&spelled).map_err(|error| {
        CliError::usage(
            scrub(&format!("the database URL does not parse: {error}"), url),
            "DATABASE_URL (or --database-url) must look like mysql://USER[:PASSWORD]@HOST[:PORT]/DB",
        )
    })?;
    server_pool::<sqlx::MySql>(url, options, "MariaDB").await
}

/// A small pool on the database server at `url` (`server` names it in the
/// hint), once one connection proved it reachable, so that a failure shows
/// the real cause rather than a pool timeout. The URL may hold a password:
/// errors never print it.
async fn server_pool<DB: sqlx::Database>(
    url: &str,
    options: <DB::Connection as Connection>::Options,
    server: &str,
) -> Result<sqlx::Pool<DB>, CliError> {
    let unreachable = |cause: String| {
        CliError::new(
            scrub(
                &format!("cannot connect to the database at {}: {cause}", redact(url)),
                url,
            ),
            format!("check that {server} runs and that DATABASE_URL (or --database-url) is right"),
        )
    };
    // A timeout around a connection attempt, never around a transaction.
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, DB::Connection::connect_with(&options))
        .await
        .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|error| unreachable(error.to_string()))?;
    let _ = probe.close().await;
    Ok(sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options))
}

/// A small pool on the SQLite file `url` names, which must exist unless
/// `create` allows and the URL asks (`?mode=rwc`) to create it. The file's
/// `journal_mode` and the services' settings are left as they are.
async fn sqlite(url: &str, create: Create) -> Result<SqlitePool, CliError> {
    // `SqliteConnectOptions` strips a lower-case scheme only.
    let rest = &url["sqlite:".len()..];
    let (file, query) = rest.split_once('?').unwrap_or((rest, ""));
    let parameter = |name: &str| {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value)
    };
    let in_memory = || {
        CliError::usage(
            format!(
                "the database URL {} names no file: an in-memory SQLite database lives and dies with the process that opened it, so no other process can read it",
                redact(url)
            ),
            "point DATABASE_URL (or --database-url) at the services' database file, sqlite:///ABSOLUTE/PATH.db",
        )
    };
    if matches!(file.trim_start_matches("//"), "" | ":memory:")
        || parameter("mode") == Some("memory")
    {
        return Err(in_memory());
    }
    let creates = create == Create::IfTheUrlAsks && parameter("mode") == Some("rwc");
    let options = SqliteConnectOptions::from_str(&format!("sqlite:{rest}"))
        .map_err(|error| {
            CliError::usage(
                scrub(&format!("the database URL does not parse: {error}"), url),
                SUPPORTED,
            )
        })?
        .create_if_missing(creates);
    let path = options.get_filename().to_owned();
    if !creates && !path.exists() {
        return Err(missing_file(&path, create));
    }
    let cannot_open = |cause: String| {
        CliError::new(
            scrub(
                &format!(
                    "cannot open the SQLite database {}: {cause}",
                    path.display()
                ),
                url,
            ),
            "check that this user may read and write the file and its directory (in WAL mode SQLite keeps -wal and -shm files beside it)",
        )
    };
    let mut probe = tokio::time::timeout(CONNECT_TIMEOUT, SqliteConnection::connect_with(&options))
        .await
        .map_err(|_| cannot_open(format!("not opened within {CONNECT_TIMEOUT:?}")))?
        .map_err(|error| cannot_open(error.to_string()))?;
    // What SQLite itself opened, whatever the URL's spelling (a second
    // `mode`, an escaped value, `vfs=memdb`) made of it.
    let main_file: Option<String> =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_optional(&mut probe)
            .await
            .map_err(|error| cannot_open(error.to_string()))?;
    let _ = probe.close().await;
    if main_file.as_deref().is_none_or(str::is_empty) {
        return Err(in_memory());
    }
    Ok(SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options))
}

/// A SQLite file that is not there, with how to make it if that was meant.
fn missing_file(path: &Path, create: Create) -> CliError {
    let relative = if path.is_relative() {
        match std::env::current_dir() {
            Ok(dir) => format!(" (a relative path: from {})", dir.display()),
            Err(_) => " (a relative path)".to_owned(),
        }
    } else {
        String::new()
    };
    CliError::new(
        format!("no such database file: {}{relative}", path.display()),
        match create {
            Create::Never => {
                "check that DATABASE_URL (or --database-url) names the services' file: sqlite:///ABSOLUTE/PATH.db, or sqlite://RELATIVE/PATH.db; `idem` never creates one, except `idem migrate` with ?mode=rwc at the end of the URL"
            }
            Create::IfTheUrlAsks => {
                "check the path; to create a new database there, add ?mode=rwc to the end of the URL"
            }
        },
    )
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
                    None if parts.is_database() => shown.push_str(&format!("{userinfo}@")),
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
            Some(None) if !parts.is_database() => secrets.extend(parts.userinfo),
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

    /// A database's URL, whose user name is no secret.
    fn is_database(&self) -> bool {
        matches!(
            self.scheme,
            Some("postgres" | "postgresql" | "mysql" | "mariadb")
        )
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
    fn the_scheme_chooses_the_database_and_names_what_is_supported() {
        for (url, expected) in [
            ("postgres://alice@h/db", Scheme::Postgres),
            ("postgresql://h/db", Scheme::Postgres),
            ("POSTGRES://h/db", Scheme::Postgres),
            ("sqlite:///var/lib/ledger.db", Scheme::Sqlite),
            ("sqlite://ledger.db", Scheme::Sqlite),
            ("sqlite:ledger.db?mode=rwc", Scheme::Sqlite),
            ("mysql://alice:pw@h/db", Scheme::Mariadb),
            ("mariadb://h/db", Scheme::Mariadb),
        ] {
            assert_eq!(scheme(url).unwrap(), expected, "{url}");
        }
        for url in ["localhost/db", "alice:pw@h/db", "redis://h"] {
            let error = scheme(url).unwrap_err();
            assert_eq!(error.exit_code(), 2);
            assert!(
                error.render().contains("postgres://") && error.render().contains("sqlite:"),
                "{error:?}"
            );
            assert!(!error.render().contains(":pw@"), "{error:?}");
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
