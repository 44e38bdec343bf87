//! Which filesystem holds a SQLite file. SQLite's locks, which make a
//! racing redelivery wait for the first attempt's claim, do not hold over a
//! network filesystem: two workers could then both claim one message. So a
//! router refuses a file on a network filesystem, and warns about one on
//! FUSE or 9p, which may be either (gVisor's sandboxes and some VMs serve
//! local files as 9p).

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::SqliteConnection;

/// What holds the database file, as far as SQLite's locks go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Filesystem {
    /// A local filesystem, or one idem does not know.
    Local,
    /// A network filesystem, by name.
    Network(&'static str),
    /// FUSE or 9p: a local or a remote one (sshfs, s3fs; a VM's or a
    /// sandbox's share of the host's disk), which idem cannot tell. By name.
    Either(&'static str),
    /// `statfs(2)` did not answer within [`STATFS_WAIT`]: a network
    /// filesystem whose server is away, most likely.
    Unresponsive,
    /// No file (an in-memory database), or its filesystem could not be read
    /// (not Linux).
    Unknown,
}

/// Network filesystems by their `statfs(2)` type (linux/magic.h).
const NETWORK: &[(i64, &str)] = &[
    (0x6969, "NFS"),
    (0x517B, "SMB"),
    (0xFF53_4D42, "CIFS"),
    (0xFE53_4D42, "SMB2"),
    (0x00C3_6400, "Ceph"),
    (0x5346_414F, "AFS"),
    (0x6B41_4653, "kAFS"),
    (0x7375_7245, "Coda"),
    (0x564C, "NCP"),
];

/// Filesystems that may be local or remote, by their `statfs(2)` type.
const EITHER: &[(i64, &str)] = &[(0x6573_5546, "FUSE"), (0x0102_1997, "9p")];

/// How long `statfs(2)` may take before the filesystem counts as away.
pub(crate) const STATFS_WAIT: Duration = Duration::from_secs(5);

/// The filesystem of `statfs(2)` type `kind`.
pub(crate) fn classify(kind: i64) -> Filesystem {
    if let Some((_, name)) = EITHER.iter().find(|(magic, _)| *magic == kind) {
        return Filesystem::Either(name);
    }
    NETWORK
        .iter()
        .find(|(magic, _)| *magic == kind)
        .map_or(Filesystem::Local, |(_, name)| Filesystem::Network(name))
}

/// The main database's file on `connection` (none in memory), and its
/// filesystem.
pub(crate) async fn of(
    connection: &mut SqliteConnection,
) -> Result<(Option<PathBuf>, Filesystem), sqlx::Error> {
    let databases: Vec<(i64, String, String)> = sqlx::query_as("PRAGMA database_list")
        .fetch_all(connection)
        .await?;
    let Some(path) = databases
        .into_iter()
        .find(|(_, name, _)| name == "main")
        .map(|(_, _, file)| file)
        .filter(|file| !file.is_empty())
        .map(PathBuf::from)
    else {
        return Ok((None, Filesystem::Unknown));
    };
    // statfs on a network mount whose server is away can block: it runs on
    // a blocking thread, and is waited for a few seconds only.
    let looked_at = path.clone();
    let looking = tokio::task::spawn_blocking(move || kind_of(&looked_at));
    let filesystem = match tokio::time::timeout(STATFS_WAIT, looking).await {
        Ok(kind) => kind.ok().flatten().map_or(Filesystem::Unknown, classify),
        Err(_) => Filesystem::Unresponsive,
    };
    Ok((Some(path), filesystem))
}

/// The `statfs(2)` type of the filesystem holding `path`.
#[cfg(target_os = "linux")]
fn kind_of(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs(2) reads a NUL-terminated path and fills the struct,
    // which is plain data (all zeroes is a valid value of it).
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    // The type is 32 bits wide, signed on some targets.
    #[allow(clippy::unnecessary_cast)]
    Some(stat.f_type as i64 & 0xFFFF_FFFF)
}

#[cfg(not(target_os = "linux"))]
fn kind_of(_path: &Path) -> Option<i64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_filesystems_are_told_from_local_ones() {
        assert_eq!(classify(0x6969), Filesystem::Network("NFS"));
        assert_eq!(classify(0xFF53_4D42), Filesystem::Network("CIFS"));
        assert_eq!(classify(0x0102_1997), Filesystem::Either("9p"));
        assert_eq!(classify(0x6573_5546), Filesystem::Either("FUSE"));
        // ext4, tmpfs, overlayfs, xfs, btrfs.
        for local in [0xEF53, 0x0102_1994, 0x794C_7630, 0x5846_5342, 0x9123_683E] {
            assert_eq!(classify(local), Filesystem::Local, "{local:#x}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_type_read_is_that_of_the_paths_filesystem() {
        // /proc is procfs wherever it is mounted: a type no other has.
        assert_eq!(kind_of(Path::new("/proc")), Some(0x9fa0));
        assert_eq!(kind_of(Path::new("/no/such/path")), None);
    }
}
