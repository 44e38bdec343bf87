//! The command line, as clap reads it.

use clap::{Args, Parser, Subcommand, ValueEnum};
use idem_runtime::dead_letter;
use time::OffsetDateTime;

/// Operate an idem deployment: the state of its consumers and dedup
/// tables, its dead letters, its retention and its schema.
///
/// Connects with the same NATS_URL and DATABASE_URL as the services; the
/// database URL's scheme chooses PostgreSQL (postgres://), a SQLite file
/// (sqlite:) or MariaDB (mysql://). Prints tables for people, or JSON with
/// --json. Exits 0 on success, 1 when the operation failed or did not apply
/// to everything it selected, 2 on a bad command line.
#[derive(Debug, Parser)]
#[command(name = "idem", version, max_term_width = 100)]
pub struct Cli {
    /// The NATS server, e.g. nats://127.0.0.1:4222.
    #[arg(
        long,
        env = "NATS_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL"
    )]
    pub nats_url: Option<String>,

    /// The database with idem's dedup schema: PostgreSQL
    /// (postgres://user@host/db or postgresql://...), a SQLite file on this
    /// machine (sqlite:///absolute/path.db, sqlite://relative/path.db) or
    /// MariaDB (mysql://user@host/db or mariadb://..., or ?socket=PATH). A
    /// SQLite file is never created, except by `idem migrate` when the URL
    /// ends in ?mode=rwc.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: Option<String>,

    /// Print JSON (one document on stdout) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Per consumer: pending, ack pending, redelivered, dead letters, and
    /// its handler's claims; per handler: claims and the oldest; the
    /// outbox's pending rows, and those that keep failing with why. Needs
    /// NATS and the database.
    ///
    /// The outbox reads the same on every database, but only PostgreSQL
    /// has its NOTIFY trigger ("notify_trigger": null with --json on SQLite
    /// and MariaDB, whose relays poll). On SQLite and MariaDB expiry names
    /// the handlers whose claims outlived their retention. On SQLite
    /// durability shows journal_mode and synchronous (synchronous as this
    /// command's connections have it: each connection sets its own); and
    /// "write_lock" says whether SQLite's write lock could be taken within
    /// 5 s, since while another connection holds it no router on the file
    /// makes progress.
    Status,

    /// List, show, replay and discard dead letters. Needs NATS.
    #[command(name = "dead-letters")]
    DeadLetters(DeadLetters),

    /// Ask the dedup table. Needs the database.
    #[command(subcommand)]
    Dedup(Dedup),

    /// Act on the transactional outbox's rows. Needs the database.
    #[command(subcommand)]
    Outbox(OutboxAction),

    /// Run the retention purge now. On PostgreSQL: end a generation
    /// transition, rotate, drop expired generations. On SQLite and MariaDB:
    /// delete each handler's claims older than its retention (--json:
    /// "deleted"). Needs the database.
    Purge,

    /// Create or upgrade idem's dedup schema. Needs the database. A SQLite
    /// file that does not exist is created only when the URL ends in
    /// ?mode=rwc.
    Migrate,

    /// Check that idem's dedup schema is applied and current. Needs the
    /// database.
    Verify,
}

/// `idem dead-letters ...`
#[derive(Debug, Args)]
pub struct DeadLetters {
    /// The dead-letter stream.
    #[arg(long, global = true, default_value = dead_letter::DEFAULT_STREAM, value_name = "STREAM")]
    pub stream: String,

    #[command(subcommand)]
    pub action: DeadLetterAction,
}

/// What to do with dead letters.
#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// List dead letters, oldest first, with why each failed.
    List {
        #[command(flatten)]
        filter: FilterArgs,
    },

    /// Show one dead letter: every header, and its payload.
    Show {
        /// Its sequence in the dead-letter stream (from `list`).
        sequence: u64,
    },

    /// Publish dead letters back to their subjects, each for the handler
    /// that dead-lettered it alone (the other routes of its subject skip
    /// it), under the id it was deduplicated by, so one whose original was
    /// in fact processed is skipped. Fix the cause first.
    ///
    /// Refused, as by `dead_letter::replay`: a dead letter that records no
    /// message id, one whose original's claim may be purged already, one
    /// no route would apply (its handler renamed or gone), one whose replay
    /// would be too large, and one JetStream drops as a duplicate (replayed
    /// within its stream's duplicate window). Dead letters stay in their
    /// stream unless --discard is given.
    Replay {
        #[command(flatten)]
        target: Target,
        /// Show what would be replayed or refused, and publish nothing.
        #[arg(long)]
        dry_run: bool,
        /// Delete each dead letter once JetStream has stored its replay.
        #[arg(long)]
        discard: bool,
        /// Also replay dead letters that record no message id: each gets a
        /// new one, so if it was in fact processed, it is applied again.
        #[arg(long)]
        allow_new_message_id: bool,
        /// Also replay dead letters older than their route's retention: if
        /// the original was processed, its claim may be gone and the replay
        /// is applied again.
        #[arg(long)]
        allow_outside_retention: bool,
        /// Replay them for the handler named NAME instead of the one that
        /// dead-lettered each (after a rename: the new name). Claims are
        /// per handler: if NAME processed the message, it is applied again.
        #[arg(long, value_name = "NAME")]
        for_handler: Option<String>,
    },

    /// Delete dead letters for good.
    Discard {
        #[command(flatten)]
        target: Target,
        /// Show what would be deleted, and delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Which dead letters `list` shows.
#[derive(Debug, Clone, Args)]
pub struct FilterArgs {
    /// Only those of this handler (its `#[idempotent(name)]`).
    #[arg(long, value_name = "NAME")]
    pub handler: Option<String>,

    /// Only those that failed this way.
    #[arg(long, value_enum, value_name = "KIND")]
    pub failure: Option<FailureKind>,

    /// Only those dead-lettered at or after this time: RFC 3339
    /// (2026-11-30T21:00:00Z) or an age (90m, 2h, 7d).
    #[arg(long, value_parser = parse_time, value_name = "TIME")]
    pub since: Option<OffsetDateTime>,

    /// Only those dead-lettered before this time: RFC 3339 or an age.
    #[arg(long, value_parser = parse_time, value_name = "TIME")]
    pub until: Option<OffsetDateTime>,

    /// Only those stored under this subject (wildcards allowed), such as
    /// one route's idem.dead.STREAM.DURABLE.
    #[arg(long, value_name = "SUBJECT")]
    pub subject: Option<String>,

    /// At most this many, the oldest.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
}

impl FilterArgs {
    /// Whether any condition is set.
    pub fn is_set(&self) -> bool {
        self.handler.is_some()
            || self.failure.is_some()
            || self.since.is_some()
            || self.until.is_some()
            || self.subject.is_some()
    }

    /// The runtime's filter.
    pub fn filter(&self) -> dead_letter::Filter {
        let mut filter = dead_letter::Filter::new();
        if let Some(handler) = &self.handler {
            filter = filter.handler(handler.clone());
        }
        if let Some(failure) = self.failure {
            filter = filter.failure(failure.into());
        }
        if let Some(since) = self.since {
            filter = filter.since(since);
        }
        if let Some(until) = self.until {
            filter = filter.until(until);
        }
        if let Some(subject) = &self.subject {
            filter = filter.subject(subject.clone());
        }
        if let Some(limit) = self.limit {
            filter = filter.limit(limit);
        }
        filter
    }
}

/// Which dead letters `replay` and `discard` act on: sequences, or filters,
/// or --all.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// Their sequences in the dead-letter stream (from `list`).
    #[arg(value_name = "SEQUENCE", conflicts_with = "all")]
    pub sequences: Vec<u64>,

    /// Every dead letter that passes the filters (all of them without any).
    #[arg(long)]
    pub all: bool,

    #[command(flatten)]
    pub filter: FilterArgs,
}

/// The `Idem-Failure` kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailureKind {
    /// The handler failed with a permanent error.
    Permanent,
    /// The handler kept failing until the route's delivery limit.
    Exhausted,
    /// The payload does not decode.
    Undecodable,
    /// The message id is empty or too long.
    BadMessageId,
    /// JetStream stopped redelivering it.
    Undeliverable,
    /// It reached the route without JetStream delivery metadata.
    #[value(name = "not-a-jetstream-delivery")]
    NotAJetstreamDelivery,
}

impl From<FailureKind> for dead_letter::Failure {
    fn from(kind: FailureKind) -> dead_letter::Failure {
        match kind {
            FailureKind::Permanent => dead_letter::Failure::Permanent,
            FailureKind::Exhausted => dead_letter::Failure::Exhausted,
            FailureKind::Undecodable => dead_letter::Failure::Undecodable,
            FailureKind::BadMessageId => dead_letter::Failure::BadMessageId,
            FailureKind::Undeliverable => dead_letter::Failure::Undeliverable,
            FailureKind::NotAJetstreamDelivery => dead_letter::Failure::NotADelivery,
        }
    }
}

/// `idem dedup ...`
#[derive(Debug, Subcommand)]
pub enum Dedup {
    /// Was this message processed by this handler, and when?
    Check {
        /// The handler's name (its `#[idempotent(name)]`).
        handler: String,
        /// The message id it deduplicates by (its key, or Nats-Msg-Id).
        message_id: String,
    },
}

/// `idem outbox ...`
#[derive(Debug, Subcommand)]
pub enum OutboxAction {
    /// Retry failing outbox rows now (`idem status` lists them, with why
    /// they failed), and restart their back-off: once the cause is fixed
    /// (the stream created, the permission granted, the stream's
    /// max_msg_size raised). A running relay publishes them within about a
    /// second, on PostgreSQL, SQLite and MariaDB alike.
    Retry {
        /// Only the rows of this subject.
        #[arg(long, value_name = "SUBJECT")]
        subject: Option<String>,
    },
}

/// An RFC 3339 time, or an age before now (`90m`, `2h`, `7d`).
fn parse_time(text: &str) -> Result<OffsetDateTime, String> {
    if let Ok(at) = OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339) {
        return Ok(at);
    }
    let age = humantime::parse_duration(text).map_err(|_| {
        format!(
            "`{text}` is neither an RFC 3339 time (2026-11-30T21:00:00Z) nor an age (90m, 2h, 7d)"
        )
    })?;
    let age = time::Duration::try_from(age).map_err(|_| format!("`{text}` is too long ago"))?;
    OffsetDateTime::now_utc()
        .checked_sub(age)
        .ok_or_else(|| format!("`{text}` is too long ago"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn times_are_rfc3339_or_ages() {
        let at = parse_time("2026-11-30T21:00:00Z").unwrap();
        assert_eq!(at.unix_timestamp(), 1_796_072_400);
        let hour_ago = parse_time("1h").unwrap();
        let expected = OffsetDateTime::now_utc() - time::Duration::hours(1);
        assert!((hour_ago - expected).abs() < time::Duration::seconds(5));
        assert!(
            parse_time("yesterday-ish")
                .unwrap_err()
                .contains("RFC 3339")
        );
    }

    #[test]
    fn failure_kinds_are_named_as_in_the_headers() {
        for kind in FailureKind::value_variants() {
            let name = kind.to_possible_value().unwrap().get_name().to_owned();
            assert_eq!(dead_letter::Failure::from(*kind).as_str(), name);
        }
    }
}
