//! Expiry of claims: the claims table's generations, their rotation, and
//! the purge that drops the ones older than the retention.
//!
//! Claims live in `idem_claims`, partitioned by generation (see the
//! migration `0002_claims_by_generation.sql` for the claim's side of it).
//! [`purge`] runs beside every router that has a route with a retention
//! (`Route::retention`), and can be run on demand, from a cron job say.
//! Each run, under a session advisory lock so that concurrent purgers do no
//! work twice:
//!
//! 1. **Finishes an expiry an earlier run began** (see *Resuming* below).
//! 2. **Ends a transition** once no transaction can still insert a claim
//!    with a view of the generation state from before the rotation (see
//!    *What a transition waits for*). Until then claims go into both open
//!    generations; after it the older one is *sealed*: no claim can still
//!    be writing into it.
//! 3. **Rotates** when the current generation is older than the generation
//!    length (half the retention): a new partition is created and attached
//!    (`ATTACH PARTITION` takes `SHARE UPDATE EXCLUSIVE` on the parent, which
//!    claims never wait for), and becomes current, in transition.
//! 4. **Expires** each generation sealed longer than the retention ago: the
//!    claims in it of handlers that keep theirs forever are copied into the
//!    kept partition, then it is detached with `DETACH PARTITION ...
//!    CONCURRENTLY`, dropped (a large one piece by piece, see *Pieces*),
//!    and forgotten. No row is deleted one by one, so nothing needs
//!    vacuuming and no index bloats.
//!
//! The retention applied is the longest any registered handler asks for:
//! retention is a minimum. A claim lives at least that long after it was
//! made, and at most about one generation length more.
//!
//! No step takes a lock a claim waits for: DDL on the parent takes `SHARE
//! UPDATE EXCLUSIVE` (claims take `ROW EXCLUSIVE` and `ACCESS SHARE`), new
//! and detached partitions are not in any claim's way, and every statement
//! runs under a `lock_timeout`, so a purge that meets another's DDL fails
//! and tries again at its next run rather than queue.
//!
//! # Pieces
//!
//! A dropped table's files are freed at the `DROP`'s commit, all at once.
//! Freeing a gigabyte keeps a disk that discards what is freed (ext4
//! mounted with `discard`, many virtual and cloud volumes) busy for about
//! half a second, and every `fsync` meanwhile waits: each COMMIT's WAL
//! flush, and JetStream's. Dropping one 10M-claim generation (1 GB) raised
//! the end-to-end p99 of the messages around it from 5.4 ms to 76 ms.
//!
//! So a large generation is made of *pieces*, which are dropped one at a
//! time. At rotation the next generation is created as that many hash
//! partitions of the key (`PARTITION BY HASH (key)`, [`pieces_for`]): as
//! many as it takes for pieces of [`DEFAULT_PIECE_BYTES`] at the size the
//! current generation has reached, at most [`MAX_PIECES`]. The database
//! setting [`PIECE_BYTES_SETTING`] changes the piece size. Once detached,
//! its pieces are dropped one per statement, with a pause after each of a
//! hundred times as long as its drop took (at most 10 s, and at most a
//! quarter of a generation over all the pieces, so that an expiry never
//! makes the next rotation late), and then the
//! partition itself, with the generation's record. A small generation (and
//! the first, which the migration made) is one table, as before.
//!
//! A claim probes and inserts into one piece of each generation, but its
//! plan holds a lock on every piece of every generation: pieces cost every
//! claim a little server CPU (see the guide's retention chapter for the
//! figures), which is why they are capped.
//!
//! # Resuming
//!
//! A run can end between any two statements: the router stops, the process
//! is killed, `idem purge` gets Ctrl-C, the database fails over. `DETACH
//! ... CONCURRENTLY` cannot run in a transaction block, so an expiry is
//! several steps, and each accepts every state an interrupted run can leave.
//! An expiry reads where its generation stands from the catalog (attached,
//! detach pending, detached, or gone) and goes on from there: it copies the
//! kept claims while the partition is readable (again, harmlessly, if a run
//! was cut short after the copy), detaches or finalizes a pending detach,
//! and drops the partition and forgets the generation in one transaction.
//! Its pieces are dropped one by one, each in a statement of its own, so a
//! run cut short between two leaves the generation detached with fewer
//! pieces, and the next run drops the rest.
//! A generation that is sealed but no longer attached is finished at the
//! start of every run, before anything else and whatever the retention now
//! is: once detached, its claims are out of every claim's sight already. A
//! rotation is resumable the same way: a partition attached by a run cut
//! short is found attached, and a transition whose transactions were not
//! recorded is recorded by the next run.
//!
//! A step that fails (most often on its `lock_timeout`: a `DETACH` waits
//! for every transaction that holds a lock on the claims table, a
//! forgotten `BEGIN; SELECT ... FROM idem_processed` included) does not
//! stop the steps that do not depend on it: the transition still ends and
//! the table still rotates; only the expiries wait (PostgreSQL allows one
//! pending detach per table). The run then fails with a [`PurgeFailure`]
//! naming its step and, for a lock timeout, the transactions older than
//! the timeout that held locks on the claims table. Every run records its
//! outcome in `idem_expiry_state`; a router's purge also logs each failure
//! at `warn` and counts it (see [`metrics`](crate::observe::metrics)). A router
//! stops its purge between runs at shutdown, and waits for the run in
//! progress within its grace period; past that it leaves it to finish.
//!
//! # What a transition waits for
//!
//! The older generation may be sealed only once no transaction can still
//! insert a claim into it, which a claim does only with a view of the state
//! from before the rotation (`R`, the rotating transaction, whose id
//! `idem_expiry_state.rotated_xid` records). Right after `R` commits, the
//! purge records the transactions of **this database** that are running
//! (`pg_locks` and `pg_stat_activity` span the whole server, but only a
//! backend connected to this database can touch its tables); transactions
//! that begin later see `R`. At each run a recorded transaction still holds
//! the transition only if
//!
//! - it holds a write lock on the claims table or one of its partitions:
//!   it has claimed (that lock is kept until it ends), or is about to; or
//! - its backend holds a snapshot that may predate `R`'s commit:
//!   `backend_xmin` at or before `R` (a snapshot that does not see `R` has
//!   it among its running transactions, so its xmin is at or before `R`;
//!   one whose xmin is above `R` sees it). A claim statement reads the
//!   state with its snapshot, so one running, or a REPEATABLE READ
//!   transaction that took its snapshot before `R` and claims later, is
//!   held for. The check is
//!   conservative: another transaction left open anywhere on the server
//!   holds every new snapshot's xmin down, so a recorded backend that is
//!   running any statement is waited for until that statement ends.
//!
//! A recorded transaction that meets neither condition is dropped from the
//! record for good: it has not claimed, and any snapshot it takes from then
//! on sees `R`. The snapshots are read before the locks, in two statements:
//! a transaction seen without a snapshot and then without a lock began no
//! claim before the first read. Prepared transactions (two-phase commit)
//! that hold a write lock on the claims table are waited for too.
//!
//! An idle READ COMMITTED transaction holds no snapshot and is not waited
//! for, nor is one in another database. An idle REPEATABLE READ
//! transaction of this database whose snapshot predates `R` (a `pg_dump`,
//! a report) is waited for: it could claim with that snapshot, and nothing
//! on the server tells it apart from a worker that will. A transition that
//! has waited a generation length (at most a minute) is logged at `warn` at
//! every run, naming each transaction it waits for; [`PurgeReport`] and
//! [`status::expiry`](crate::status::expiry) show them, and the metrics
//! count them.

use sqlx::Pool;

use crate::store::backend::Backend;

pub use crate::error::retention::{Blocker, Holds, PurgeFailure};
pub use crate::store::purge::{
    APPLICATION_NAME, DEFAULT_PIECE_BYTES, MAX_PIECES, PIECE_BYTES_SETTING, PurgeReport,
    Transition, generation_length, pieces_for, transition_warn_after,
};

/// Runs the expiry once, on any database: on PostgreSQL, rotates and
/// drops generations as described above; on SQLite (feature `sqlite`),
/// deletes each handler's claims older than its retention, in chunks
/// ([`PurgeReport::deleted`]). Safe to run from any number of processes at
/// once (on PostgreSQL all but one skip). A router runs it beside its
/// routes; call it yourself from a cron job or a maintenance task
/// (`idem purge` does).
pub async fn purge<DB: Backend>(pool: &Pool<DB>) -> Result<PurgeReport, crate::Error> {
    DB::purge(pool).await
}
#[cfg(feature = "fault-injection")]
pub use crate::store::purge::{Step, purge_ending_session_at};
