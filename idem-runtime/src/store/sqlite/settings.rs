//! What a router's start-up and `idem status` read of a SQLite file besides
//! its claims: the settings that decide whether an acked commit survives a
//! power loss (one rule for both), and its one write lock.

use std::time::{Duration, Instant};

use std::path::PathBuf;

use sqlx::{AssertSqlSafe, Connection, SqliteConnection, SqlitePool};

use super::filesystem::{self, Filesystem};

/// `journal_mode` and `synchronous`, as one connection sees them (WAL mode
/// is kept in the file, `synchronous` is each connection's own), and where
/// the file is.
pub(crate) struct Settings {
    /// Lower case: `wal`, `delete`, ...
    pub(crate) journal_mode: String,
    /// 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA.
    pub(crate) synchronous: i64,
    /// The main database's file; none in memory.
    pub(crate) file: Option<PathBuf>,
    /// What holds it.
    pub(crate) filesystem: Filesystem,
}

impl Settings {
    /// Reads them on `connection`.
    pub(crate) async fn read(connection: &mut SqliteConnection) -> Result<Settings, sqlx::Error> {
        let journal_mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *connection)
            .await?;
        let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *connection)
            .await?;
        let (file, filesystem) = filesystem::of(connection).await?;
        Ok(Settings {
            journal_mode: journal_mode.to_ascii_lowercase(),
            synchronous,
            file,
            filesystem,
        })
    }

    /// Why a router must not run on this file: it is on a network
    /// filesystem, where SQLite's locks do not hold, so two workers could
    /// both claim one message.
    pub(crate) fn refusal(&self) -> Option<String> {
        match self.filesystem {
            Filesystem::Network(name) => Some(format!(
                "the SQLite file {} is on {name}, a network filesystem: SQLite's locks do not \
                 hold there, so two workers could both claim one message and apply it twice; \
                 keep the file on a local disk",
                self.file_shown()
            )),
            Filesystem::Unresponsive => Some(format!(
                "statfs(2) on the SQLite file {} did not answer within {:?}: a network \
                 filesystem whose server is away? SQLite's locks do not hold on one; keep the \
                 file on a local disk",
                self.file_shown(),
                filesystem::STATFS_WAIT
            )),
            _ => None,
        }
    }

    /// The file, for messages.
    fn file_shown(&self) -> String {
        self.file.as_ref().map_or_else(
            || "(in memory)".to_owned(),
            |file| file.display().to_string(),
        )
    }

    /// What holds the file, for `idem status`: `local`, `NFS (network)`,
    /// `FUSE (local or network)`, `not answering (network?)` or `unknown`.
    pub(crate) fn filesystem_name(&self) -> String {
        match self.filesystem {
            Filesystem::Local => "local".to_owned(),
            Filesystem::Network(name) => format!("{name} (network)"),
            Filesystem::Either(name) => format!("{name} (local or network)"),
            Filesystem::Unresponsive => "not answering (network?)".to_owned(),
            Filesystem::Unknown => "unknown".to_owned(),
        }
    }

    /// `synchronous` by name: `off`, `normal`, `full` or `extra`.
    pub(crate) fn synchronous_name(&self) -> String {
        match self.synchronous {
            0 => "off".to_owned(),
            1 => "normal".to_owned(),
            2 => "full".to_owned(),
            3 => "extra".to_owned(),
            other => other.to_string(),
        }
    }

    /// What can lose acked commits, or slow them, as said of `whose`
    /// connections ("this router's", "this command's"): `synchronous` OFF,
    /// or below FULL in WAL mode (NORMAL is durable with a rollback journal,
    /// but in WAL mode a power loss can take the last commits); no rollback
    /// journal at all (OFF, MEMORY), under which a rollback may not undo;
    /// and any other journal than WAL, under which readers wait for the
    /// writer.
    pub(crate) fn warnings(&self, whose: &str) -> Vec<String> {
        let wal = self.journal_mode == "wal";
        let mut warnings = Vec::new();
        if self.synchronous == 0 || (wal && self.synchronous < 2) {
            warnings.push(format!(
                "SQLite's `synchronous` is {} on {whose} connections: a power loss can lose \
                 commits whose messages were acked, and their effects are gone while JetStream \
                 redelivers nothing; set `SqliteConnectOptions::synchronous(SqliteSynchronous::Full)`",
                self.synchronous_name().to_ascii_uppercase()
            ));
        }
        if let Some(refusal) = self.refusal() {
            warnings.push(format!("{refusal}; a router refuses to start on it"));
        }
        if let Filesystem::Either(name) = self.filesystem {
            warnings.push(format!(
                "the SQLite file {} is on a {name} filesystem: if that is a network one (sshfs, \
                 s3fs, a share on another machine), SQLite's locks do not hold there and two \
                 workers could both claim one message; keep the file on a local disk",
                self.file_shown()
            ));
        }
        match self.journal_mode.as_str() {
            "wal" => {}
            // Without a rollback journal a ROLLBACK is not guaranteed to
            // undo anything: a failed handler's writes can stay, and its
            // retry applies them again; a crash can corrupt the file.
            "off" | "memory" => warnings.push(format!(
                "SQLite's journal_mode is {}: a ROLLBACK may not undo a failed handler's writes                  (its retry then applies them again) and a crash can corrupt the file, so idem                  cannot apply each message once; set                  `SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)`",
                self.journal_mode.to_ascii_uppercase()
            )),
            _ => warnings.push(format!(
                "SQLite is not in WAL mode (journal_mode {}): readers wait for the writer; set                  `SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)`",
                self.journal_mode
            )),
        }
        warnings
    }
}

/// Whether SQLite's write lock, one for the whole file, could be taken:
/// every message's transaction takes it at BEGIN, so while another
/// connection holds it no router on the file makes progress.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteLock {
    /// Taken and released at once: nothing held it past the wait.
    Free,
    /// Still taken by another connection after `waited` (SQLite does not
    /// say which), and nothing was committed meanwhile: a transaction left
    /// open in another process or shell, or a handler that runs that long.
    Held {
        /// How long the probe waited for it.
        waited: Duration,
    },
    /// Not taken within `waited`, but other connections committed
    /// meanwhile: the lock changes hands too often for the probe to get a
    /// turn (SQLite's busy handler is not fair), and work goes on.
    Busy {
        /// How long the probe waited for it.
        waited: Duration,
    },
    /// Not tried: this pool cannot write (opened with `mode=ro`, or the
    /// file is read-only to this user). SQLite's message.
    NotChecked(String),
}

/// Takes the write lock (`BEGIN IMMEDIATE`) on one of `pool`'s
/// connections, waiting up to `wait`, and rolls back at once: nothing is
/// written. When it cannot, `PRAGMA data_version` (which changes when
/// another connection commits) tells a lock that is stuck from one that is
/// busy. A read-only connection's `BEGIN IMMEDIATE` takes no lock, so a
/// write that changes nothing (`DELETE FROM idem_claims WHERE false`) tells
/// one apart: the file must hold idem's schema. The connection is closed
/// afterwards, since its busy timeout was changed for the probe.
pub(crate) async fn write_lock(
    pool: &SqlitePool,
    wait: Duration,
) -> Result<WriteLock, sqlx::Error> {
    let mut connection = pool.acquire().await?;
    connection.close_on_drop();
    let millis = wait.as_millis().min(i32::MAX as u128);
    sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA busy_timeout = {millis}")))
        .execute(&mut *connection)
        .await?;
    let before = data_version(&mut connection).await?;
    let started = Instant::now();
    let taken = match connection.begin_with("BEGIN IMMEDIATE").await {
        Ok(mut tx) => {
            let wrote = sqlx::query("DELETE FROM idem_claims WHERE false")
                .execute(&mut *tx)
                .await;
            tx.rollback().await?;
            wrote.map(|_| ())
        }
        Err(error) => Err(error),
    };
    match taken {
        Ok(()) => Ok(WriteLock::Free),
        Err(error) if crate::error::class::is_lock_timeout(&error) => {
            let waited = started.elapsed();
            if data_version(&mut connection).await? == before {
                Ok(WriteLock::Held { waited })
            } else {
                Ok(WriteLock::Busy { waited })
            }
        }
        Err(sqlx::Error::Database(error)) if is_read_only(error.code().as_deref()) => {
            Ok(WriteLock::NotChecked(error.message().to_owned()))
        }
        Err(error) => Err(error),
    }
}

/// A number that changes whenever another connection commits to the file.
async fn data_version(connection: &mut SqliteConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("PRAGMA data_version")
        .fetch_one(connection)
        .await
}

/// SQLITE_READONLY and its extended codes.
fn is_read_only(code: Option<&str>) -> bool {
    code.and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(journal_mode: &str, synchronous: i64) -> Vec<String> {
        Settings {
            journal_mode: journal_mode.to_owned(),
            synchronous,
            file: None,
            filesystem: Filesystem::Local,
        }
        .warnings("these")
    }

    #[test]
    fn a_file_on_a_network_filesystem_is_refused_and_one_on_fuse_or_9p_warned_about() {
        let on = |filesystem| Settings {
            journal_mode: "wal".to_owned(),
            synchronous: 2,
            file: Some(PathBuf::from("/mnt/share/ledger.db")),
            filesystem,
        };
        let nfs = on(Filesystem::Network("NFS"));
        let refusal = nfs.refusal().expect("NFS is refused");
        assert!(refusal.contains("/mnt/share/ledger.db is on NFS, a network filesystem"));
        assert!(nfs.warnings("these")[0].contains("a router refuses to start on it"));
        let fuse = on(Filesystem::Either("FUSE"));
        assert_eq!(fuse.refusal(), None);
        assert!(fuse.warnings("these")[0].contains("on a FUSE filesystem"));
        let away = on(Filesystem::Unresponsive);
        assert!(
            away.refusal()
                .expect("refused")
                .contains("did not answer within 5s")
        );
        assert!(on(Filesystem::Local).warnings("these").is_empty());
    }

    #[test]
    fn synchronous_below_full_in_wal_mode_and_other_journals_are_warned_about() {
        assert!(warnings("wal", 2).is_empty());
        assert!(warnings("wal", 3).is_empty());
        assert!(warnings("wal", 1)[0].contains("`synchronous` is NORMAL on these connections"));
        assert!(warnings("wal", 0)[0].contains("`synchronous` is OFF"));
        // NORMAL is durable with a rollback journal; only the journal warns.
        let delete = warnings("delete", 1);
        assert_eq!(delete.len(), 1, "{delete:?}");
        assert!(delete[0].contains("not in WAL mode (journal_mode delete)"));
        assert_eq!(warnings("delete", 0).len(), 2);
        // Without a rollback journal, rollbacks themselves are in doubt.
        let off = warnings("off", 2);
        assert_eq!(off.len(), 1, "{off:?}");
        assert!(off[0].contains("journal_mode is OFF: a ROLLBACK may not undo"));
        assert!(warnings("memory", 2)[0].contains("journal_mode is MEMORY"));
    }
}
