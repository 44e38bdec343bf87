//! Whether a route's database can be used: the pause that stops a route from
//! taking new messages while it cannot.
//!
//! An attempt that fails before its handler runs (no connection, BEGIN or
//! the claim failed) is the database's fault. The message is held and
//! retried; if its immediate retry fails too, the route is paused: the pull
//! loop takes nothing new, and keeps what it fetched but did not start
//! leased (heartbeats), so that fetched messages neither age past ack_wait
//! in a queue that cannot move nor use up a delivery (see `pull.rs`). The
//! first attempt that gets past its claim resumes the route.

use tokio::sync::watch;

use crate::observe::recorder::Recorder;

pub(crate) struct Health {
    paused: watch::Sender<bool>,
    /// Where a pause shows: `Stats::paused` and `idem_route_paused`.
    recorder: Recorder,
}

impl Health {
    pub(crate) fn new(recorder: Recorder) -> Self {
        Self {
            paused: watch::Sender::new(false),
            recorder,
        }
    }

    /// The database cannot be used: stop taking messages.
    pub(crate) fn pause(&self) {
        self.set(true);
    }

    /// An attempt got past its claim (or the database answered, see
    /// `pull.rs`): take messages again.
    pub(crate) fn resume(&self) {
        self.set(false);
    }

    /// Recorded under the watch's lock, so that a pause and a resume that
    /// race leave the stats as they leave the route.
    fn set(&self, paused: bool) {
        self.paused.send_if_modified(|now| {
            let changed = std::mem::replace(now, paused) != paused;
            if changed {
                self.recorder.paused(paused);
            }
            changed
        });
    }

    pub(crate) fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Resolves once the route is paused.
    pub(crate) async fn paused(&self) {
        let mut paused = self.paused.subscribe();
        let _ = paused.wait_for(|paused| *paused).await;
    }

    /// Resolves once the route is no longer paused.
    pub(crate) async fn resumed(&self) {
        let mut paused = self.paused.subscribe();
        let _ = paused.wait_for(|paused| !*paused).await;
    }
}
