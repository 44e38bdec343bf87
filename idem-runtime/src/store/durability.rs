//! What idem needs from PostgreSQL's durability, and how it gets it.
//!
//! idem acks a message (or replies to a request) once its transaction has
//! committed. That is only safe if the COMMIT is durable when PostgreSQL
//! reports it: with `synchronous_commit = off` (a common tuning, for the
//! server, a database, a role, or a session) COMMIT returns before its WAL
//! reaches disk, and a crash of the server then loses the latest commits. A
//! message acked after one of them is lost with its effect: JetStream never
//! redelivers it. With asynchronous streaming replication, a failover to the
//! standby loses the same way.
//!
//! So every transaction whose COMMIT precedes an ack or a reply (per
//! message, a batch, a batch's fallback to one transaction per message, a
//! request/reply route: they all begin and commit through
//! [`transaction`](crate::store::transaction)) commits with **at least
//! `synchronous_commit = on`**, set transaction-locally twice: at BEGIN, so
//! that the handler (and anything it reads) sees the level its transaction
//! commits with, and again in the COMMIT message itself, so that a handler
//! that lowers it (`SET LOCAL synchronous_commit = off`) cannot make its own
//! commit lose. A stronger level the pool's sessions already have
//! (`remote_apply`) is kept, never lowered.
//!
//! **Synchronous standbys.** With `synchronous_standby_names` set, `on`
//! makes each COMMIT wait until a synchronous standby has flushed it to
//! disk, so a failover to that standby loses nothing idem acked. idem asks
//! for `on`, not `remote_apply`: a promoted standby replays everything it
//! has flushed before it accepts writes, so every claim is there after the
//! failover; `remote_apply` also waits until the standby has *applied* the
//! commit, which only readers of the standby need, and ties every COMMIT to
//! the standby's replay, which its queries can hold back for up to
//! `max_standby_streaming_delay`. A server set to `remote_apply` keeps it.
//! (Under `ANY n (...)` each commit waits for n of the named standbys:
//! fail over to the most advanced one, as failover tools do.)
//!
//! **The wait for a standby is not cut short by the handler timeout.**
//! PostgreSQL turns a cancelled wait for a standby into a COMMIT reported as
//! successful, with only a warning ("the transaction has already committed
//! locally, but might not have been replicated to the standby"), which
//! would let the ack come before the standby's copy. The statement timeout
//! the handler timeout sets cannot do that: PostgreSQL stops it before the
//! commit itself runs (a COMMIT under a 1 s statement timeout waited for a
//! stopped standby past three of them and past the watchdog, and its
//! message was acked only once the standby was back:
//! `with_a_synchronous_standby_the_ack_waits_until_the_standby_has_the_commit`).
//! A `pg_cancel_backend` of a backend waiting for its standby (shown with
//! `wait_event` `SyncRep`) can: do not cancel those. A COMMIT that waits for
//! an absent standby waits; the watchdog (`Pipeline::watched`) stops
//! waiting for it after the transaction's bounds and settles the message as
//! of unknown outcome (never acked), and its redelivery finds the claim once
//! the standby is back.
//!
//! **At start-up** [`check`] reads the sessions' `synchronous_commit`,
//! `synchronous_standby_names` and `pg_stat_replication`, and warns about
//! what can still lose commits: a default of `off` (idem's own commits are
//! covered; the application's other writes are not), a default of `local`
//! or `remote_write` while synchronous standbys are named (the same for
//! replication), a standby that replicates asynchronously (a failover to it
//! loses), and synchronous standby names that no connected standby matches
//! (every COMMIT waits until one connects: the routes stop). The warnings
//! come once per start-up, before anything is written (with every
//! synchronous standby away, the first write would wait), and
//! [`status::durability`](crate::status::durability) (`idem status`) shows
//! them while they last.

use sqlx::PgPool;

/// A `synchronous_commit` level, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// COMMIT returns before its WAL is flushed.
    Off,
    /// Flushed locally; standbys not waited for.
    Local,
    /// Flushed locally; a synchronous standby has written it (not flushed).
    RemoteWrite,
    /// Flushed locally and by a synchronous standby.
    On,
    /// As `On`, and applied by the standby.
    RemoteApply,
}

impl Level {
    /// The level of a `SHOW synchronous_commit` value (which always shows
    /// one of these names, whatever spelling set it).
    fn parse(value: &str) -> Option<Level> {
        Some(match value {
            "off" => Level::Off,
            "local" => Level::Local,
            "remote_write" => Level::RemoteWrite,
            "on" => Level::On,
            "remote_apply" => Level::RemoteApply,
            _ => return None,
        })
    }

    /// Its name, as `synchronous_commit` takes it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Local => "local",
            Level::RemoteWrite => "remote_write",
            Level::On => "on",
            Level::RemoteApply => "remote_apply",
        }
    }

    /// The level idem's transactions commit with when the sessions'
    /// default is `self`: at least `on`.
    pub(crate) fn for_idem(self) -> Level {
        self.max(Level::On)
    }
}

/// The SQL expression of the level a transaction commits with, given the
/// level idem asks for as parameter `$1` (or the one named: `at_least!("$3")`;
/// `on` or `remote_apply`): that level, unless the transaction already has
/// the stronger `remote_apply`.
macro_rules! at_least {
    () => {
        $crate::store::durability::at_least!("$1")
    };
    ($parameter:literal) => {
        concat!(
            "CASE WHEN current_setting('synchronous_commit') = 'remote_apply' \
             THEN 'remote_apply' ELSE ",
            $parameter,
            " END"
        )
    };
}
pub(crate) use at_least;

/// What the server's durability settings are, as the pool's sessions see
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    /// `synchronous_commit` (server, database, role and connection
    /// options together).
    pub(crate) synchronous_commit: String,
    /// `synchronous_standby_names`.
    pub(crate) standby_names: String,
    /// The physical standbys streaming from the server: each
    /// `application_name` and `sync_state` (`None` where this role may not
    /// read it).
    pub(crate) standbys: Vec<(String, Option<String>)>,
}

/// Reads the server's durability settings, warns (if `warn`) about what
/// can lose commits idem acks after (see the module docs), and returns the
/// level idem's transactions commit with.
pub(crate) async fn check(pool: &PgPool, warn: bool) -> Result<Level, sqlx::Error> {
    let settings = read(pool).await?;
    if warn {
        for warning in warnings(&settings) {
            tracing::warn!("{warning}");
        }
    }
    Ok(settings.commit_level())
}

/// The server's durability settings, as the pool's sessions see them.
pub(crate) async fn read(pool: &PgPool) -> Result<Settings, sqlx::Error> {
    let (synchronous_commit, standby_names): (String, String) = sqlx::query_as(
        "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names')",
    )
    .fetch_one(pool)
    .await?;
    // Physical standbys only: a logical replication subscriber is not a
    // failover target.
    let standbys: Vec<(Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT application_name, sync_state FROM pg_stat_replication r
         WHERE NOT EXISTS (SELECT FROM pg_replication_slots s
                           WHERE s.active_pid = r.pid AND s.slot_type = 'logical')
         ORDER BY application_name",
    )
    .fetch_all(pool)
    .await?;
    Ok(Settings {
        synchronous_commit,
        standby_names,
        standbys: standbys
            .into_iter()
            .map(|(name, state)| (name.unwrap_or_default(), state))
            .collect(),
    })
}

impl Settings {
    /// The level idem's transactions commit with under these settings.
    pub(crate) fn commit_level(&self) -> Level {
        Level::parse(&self.synchronous_commit)
            .unwrap_or(Level::Off)
            .for_idem()
    }
}

/// What can still lose commits idem acks after, or stop them, one sentence
/// each: what, what is lost, what idem does, what to configure.
pub(crate) fn warnings(settings: &Settings) -> Vec<String> {
    let mut warnings = Vec::new();
    let level = Level::parse(&settings.synchronous_commit);
    let names = settings.standby_names.trim();
    if level == Some(Level::Off) {
        warnings.push(
            "PostgreSQL's synchronous_commit is off for this pool's sessions: a crash of the server loses the last transactions it reported committed; idem commits its own transactions (claims, effects, outbox rows, stored replies) with synchronous_commit = on, so nothing it acks is lost, but the application's other writes are not covered; set synchronous_commit = on (the default) unless that is meant".to_owned(),
        );
    }
    if !names.is_empty() && matches!(level, Some(Level::Local | Level::RemoteWrite)) {
        warnings.push(format!(
            "PostgreSQL's synchronous_commit is {} for this pool's sessions while synchronous_standby_names is '{names}': their commits do not wait until a standby has flushed them, so a failover loses the latest; idem commits its own transactions with synchronous_commit = on, which waits; set synchronous_commit = on for the rest",
            settings.synchronous_commit
        ));
    }
    if level.is_none() {
        warnings.push(format!(
            "PostgreSQL's synchronous_commit is '{}', which idem does not know; idem commits its own transactions with synchronous_commit = on",
            settings.synchronous_commit
        ));
    }
    let asynchronous: Vec<&str> = settings
        .standbys
        .iter()
        .filter(|(_, state)| matches!(state.as_deref(), Some("async" | "potential")))
        .map(|(name, _)| name.as_str())
        .collect();
    if !asynchronous.is_empty() {
        warnings.push(format!(
            "PostgreSQL replicates asynchronously to standby {}: a failover to it loses the commits it had not received, including those of messages idem already acked (their effects are lost, and JetStream does not redeliver them); name the standbys in synchronous_standby_names (for example 'ANY 1 ({})') so that each COMMIT idem makes waits until a standby has flushed it, or fail over only to a synchronous standby",
            asynchronous.join(", "),
            asynchronous.join(", ")
        ));
    }
    let unreadable: Vec<&str> = settings
        .standbys
        .iter()
        .filter(|(_, state)| state.is_none())
        .map(|(name, _)| name.as_str())
        .collect();
    if !unreadable.is_empty() {
        warnings.push(format!(
            "{} standby connection(s) stream from PostgreSQL whose replication state this role may not read, so idem cannot tell whether a failover to them could lose acked commits; grant the role pg_monitor to have it checked",
            unreadable.len()
        ));
    }
    let synchronous = settings
        .standbys
        .iter()
        .any(|(_, state)| matches!(state.as_deref(), Some("sync" | "quorum")));
    if !names.is_empty() && !synchronous && unreadable.is_empty() {
        warnings.push(format!(
            "PostgreSQL's synchronous_standby_names is '{names}', but no connected standby is synchronous: every COMMIT idem makes waits until one connects, so the routes make no progress until then (each wait shows in pg_stat_activity as wait_event SyncRep); connect the standby, or change synchronous_standby_names"
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(level: &str, names: &str, standbys: &[(&str, Option<&str>)]) -> Settings {
        Settings {
            synchronous_commit: level.to_owned(),
            standby_names: names.to_owned(),
            standbys: standbys
                .iter()
                .map(|(name, state)| ((*name).to_owned(), state.map(str::to_owned)))
                .collect(),
        }
    }

    #[test]
    fn idem_commits_with_at_least_on_and_keeps_remote_apply() {
        for (default, idem) in [
            ("off", "on"),
            ("local", "on"),
            ("remote_write", "on"),
            ("on", "on"),
            ("remote_apply", "remote_apply"),
        ] {
            let level = Level::parse(default).unwrap();
            assert_eq!(level.as_str(), default);
            assert_eq!(level.for_idem().as_str(), idem, "{default}");
        }
    }

    #[test]
    fn a_safe_server_gets_no_warning() {
        assert!(warnings(&settings("on", "", &[])).is_empty());
        // Without synchronous standbys, local is as durable as on.
        assert!(warnings(&settings("local", "", &[])).is_empty());
        let synchronous = settings("on", "s1", &[("s1", Some("sync"))]);
        assert!(warnings(&synchronous).is_empty());
        let quorum = settings("on", "ANY 1 (s1, s2)", &[("s1", Some("quorum"))]);
        assert!(warnings(&quorum).is_empty());
    }

    #[test]
    fn each_risk_gets_its_warning() {
        let off = warnings(&settings("off", "", &[]));
        assert_eq!(off.len(), 1);
        assert!(off[0].contains("synchronous_commit is off"), "{off:?}");

        let local = warnings(&settings("local", "s1", &[("s1", Some("sync"))]));
        assert_eq!(local.len(), 1);
        assert!(local[0].contains("do not wait"), "{local:?}");

        let asynchronous = warnings(&settings(
            "on",
            "s1",
            &[
                ("s1", Some("sync")),
                ("r2", Some("async")),
                ("r3", Some("potential")),
            ],
        ));
        assert_eq!(asynchronous.len(), 1);
        assert!(
            asynchronous[0].contains("asynchronously to standby r2, r3"),
            "{asynchronous:?}"
        );

        let absent = warnings(&settings("on", "s1", &[]));
        assert_eq!(absent.len(), 1);
        assert!(absent[0].contains("no connected standby"), "{absent:?}");

        let hidden = warnings(&settings("on", "", &[("", None)]));
        assert_eq!(hidden.len(), 1);
        assert!(hidden[0].contains("pg_monitor"), "{hidden:?}");
    }
}
