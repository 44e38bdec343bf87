//! The books of one pull (`pull_stream.rs`): which requests are open, how
//! big each is, when each expires, and how many messages they still owe.
//!
//! Each request has a reply subject of its own, so the server's statuses
//! (`408` at expiry, `409`, `503`, heartbeats) name the request they are
//! about, and a `408` or `409` says in `Nats-Pending-Messages` how many
//! messages that request left undelivered. A message of the stream does
//! not: JetStream delivers it under its own subject, whichever request it
//! fills. So the books count the messages received that no ended request
//! has been credited with yet ([`Books::unsettled`]), and what the open
//! requests still owe is their sizes less that count. When a request ends
//! with a count, it is credited with exactly what it delivered.
//!
//! A request the server never ends with a status (one that is filled, one
//! the server dropped because its wait list was full, or one that lived on
//! a consumer leader that died) leaves the books on its own: once its
//! expiry and a margin have passed, it cannot deliver any more. It is then
//! credited with its whole size, as a filled request is (a request still
//! waiting at its expiry gets its `408`, which comes within the margin).
//! Where that credit is a guess (no count and not provably filled), the
//! books are no longer *exact*, until they are empty again; while they are
//! exact, a zero owed proves that every request open was filled, which lets
//! [`PullStream::close`](super::pull_stream::PullStream::close) return
//! without waiting for expiries. An error in a guess only ever makes the
//! books believe more is owed than is, never less: the pull asks a little
//! later, and closing waits a little longer, until those requests expire.
//!
//! After the client reconnects, the requests open before are *stale*: a
//! server that restarted has forgotten them, one that did not (a short
//! blip; a cluster whose consumer leader is on another node) still
//! delivers them, into the same subjects, which the client subscribes
//! again. Stale requests no longer count as owed, so the pull asks again at
//! once, but they stay on the books until they end or expire, so that
//! closing still waits for them. What they deliver after the reconnect is
//! taken as it comes (at most their remaining size more than was asked
//! for), and reconciled when the last of them has ended with a count.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How long past its expiry a request without a status stays on the books:
/// a request still waiting at its expiry gets the server's `408`, which
/// follows whatever it delivered, within this margin.
pub(crate) const EXPIRY_MARGIN: Duration = Duration::from_secs(1);

/// One pull request on the books.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// Its reply subject is `{inbox}.{id}`.
    pub(crate) id: u64,
    /// The messages it asked for.
    pub(crate) size: usize,
    /// When the server forgets it (sent + its expiry).
    pub(crate) expires_at: Instant,
    /// Sent before the client's last reconnect.
    stale: bool,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A status with `Nats-Pending-Messages`: it delivered its size less
    /// this.
    Left(usize),
    /// Turned away before it waited (`503` no responders, a `409` such as
    /// `Exceeded MaxWaiting`): it delivered nothing.
    Refused,
    /// A status without a count: it delivered an unknown part of its size.
    Unknown,
    /// `409 Leadership Change`: a new consumer leader knows none of the
    /// requests the old one held. This one reached the old leader, and so
    /// did every request sent before it: all of them are over, those filled
    /// (which the new leader does not tell) too.
    LeaderChanged,
}

/// What a reconnect leaves to reconcile: the stale requests' deliveries.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Stale {
    /// Messages received before the reconnect(s), all theirs.
    before: usize,
    /// What the stale requests that ended reported delivering in all.
    reported: usize,
    /// A stale request ended without a count.
    unknown: bool,
}

/// The requests of one pull and what they owe. Every operation on a
/// message, and the expiry check, costs the same however many requests are
/// open: under a steady flow, requests that were filled stay on the books
/// until their expiry, a few seconds' worth.
#[derive(Debug)]
pub(crate) struct Books {
    /// The size wanted for each new request.
    batch: usize,
    /// The consumer's `max_batch`, if it has one.
    cap: Option<usize>,
    /// Open requests, oldest (lowest id) first; they all live equally long,
    /// so they expire in this order too.
    requests: VecDeque<Request>,
    next_id: u64,
    /// The sizes of the open requests: all, and those sent since the last
    /// reconnect; how many were sent before it.
    all: usize,
    fresh: usize,
    stale_open: usize,
    /// Messages received that no ended request was credited with yet.
    unsettled: usize,
    /// Whether `unsettled` is exactly what the open requests delivered.
    exact: bool,
    stale: Stale,
}

impl Books {
    /// Empty books for requests of `batch` messages, at most `cap`.
    pub(crate) fn new(batch: usize, cap: Option<usize>) -> Self {
        Books {
            batch: batch.max(1),
            cap: cap.filter(|cap| *cap > 0),
            requests: VecDeque::new(),
            next_id: 0,
            all: 0,
            fresh: 0,
            stale_open: 0,
            unsettled: 0,
            exact: true,
            stale: Stale::default(),
        }
    }

    /// The size of the next request: the batch wanted, at most the cap.
    pub(crate) fn size(&self) -> usize {
        self.cap.map_or(self.batch, |cap| self.batch.min(cap))
    }

    /// The size wanted, before the cap.
    pub(crate) fn wanted(&self) -> usize {
        self.batch
    }

    /// The size of the requests sent from now on (at least 1). Requests
    /// already open keep theirs.
    pub(crate) fn set_batch(&mut self, batch: usize) {
        self.batch = batch.max(1);
    }

    /// The most a request may ask for (the consumer's `max_batch`).
    pub(crate) fn set_cap(&mut self, cap: usize) {
        self.cap = Some(cap.max(1));
    }

    /// Whether the next request is smaller than wanted, because of the cap.
    pub(crate) fn capped(&self) -> bool {
        self.size() < self.batch
    }

    /// What the requests sent since the last reconnect still owe.
    pub(crate) fn owed(&self) -> usize {
        self.fresh.saturating_sub(self.unsettled)
    }

    /// Whether to ask for more: when half a request or less is owed.
    pub(crate) fn wants_more(&self) -> bool {
        self.owed() <= self.size() / 2
    }

    /// The id of the next request, whose reply subject must be ready
    /// before it is sent.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id
    }

    /// A request of `size` was handed to the client at `now`, to expire
    /// after `life` (the same for every request of a pull).
    pub(crate) fn sent(&mut self, size: usize, now: Instant, life: Duration) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.requests.push_back(Request {
            id,
            size,
            expires_at: now + life,
            stale: false,
        });
        self.all += size;
        self.fresh += size;
        id
    }

    /// Whether request `id` is on the books.
    pub(crate) fn is_open(&self, id: u64) -> bool {
        self.position(id).is_some()
    }

    /// A message of the stream arrived. When every request open is then
    /// filled, they all leave the books.
    pub(crate) fn message(&mut self) {
        if self.requests.is_empty() {
            // Late for a request that left the books at its expiry: there
            // is nothing it could be credited to.
            return;
        }
        self.unsettled += 1;
        if self.exact && self.stale_open == 0 && self.unsettled >= self.all {
            self.requests.clear();
            self.emptied();
        }
    }

    /// Request `id` ended as `end`; `None` if it was not on the books (it
    /// expired here first, or the status is for an older pull).
    pub(crate) fn end(&mut self, id: u64, end: End) -> Option<Request> {
        let index = self.position(id)?;
        let request = if end == End::LeaderChanged {
            // It and every older request: they are the first on the books.
            let mut fresh = 0;
            let mut stale = Vec::new();
            for _ in 0..index {
                let older = self.pop_front();
                if older.stale {
                    stale.push(older);
                } else {
                    fresh += older.size;
                }
            }
            let request = self.pop_front();
            if request.stale {
                stale.push(request.clone());
            } else {
                fresh += request.size;
            }
            // What came is theirs, as far as it goes: a request sent after
            // them may have reached the new leader, and is owed the rest.
            self.unsettled -= fresh.min(self.unsettled);
            self.exact = false;
            for request in &stale {
                self.end_stale(request, End::Unknown);
            }
            request
        } else {
            let request = self.take(index);
            if request.stale {
                self.end_stale(&request, end);
            } else {
                match end {
                    End::Left(left) => self.credit(request.size.saturating_sub(left)),
                    End::Refused => {}
                    End::Unknown | End::LeaderChanged => {
                        let guess = request.size.min(self.unsettled);
                        self.unsettled -= guess;
                        self.exact = false;
                    }
                }
            }
            request
        };
        if self.requests.is_empty() {
            self.emptied();
        }
        Some(request)
    }

    /// Takes off the books every request whose expiry and
    /// [`EXPIRY_MARGIN`] have passed at `now` without a status: it was
    /// filled (or the server lost it), and can deliver no more. Returns how
    /// many of them cannot have been filled, as too few messages came: the
    /// server dropped them without a word (a full wait list, a leader that
    /// died).
    pub(crate) fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        let mut lost = 0;
        while self
            .requests
            .front()
            .is_some_and(|request| request.expires_at + EXPIRY_MARGIN <= now)
        {
            let request = self.pop_front();
            expired += 1;
            if request.stale {
                self.end_stale(&request, End::Unknown);
            } else if self.unsettled >= request.size {
                // As filled: every message it asked for came.
                self.unsettled -= request.size;
            } else {
                lost += 1;
                self.unsettled = 0;
                self.exact = false;
            }
        }
        if expired > 0 && self.requests.is_empty() {
            self.emptied();
        }
        lost
    }

    /// The client reconnected: every request open becomes stale (see the
    /// module docs), and what they delivered so far is theirs.
    pub(crate) fn reconnected(&mut self) {
        if self.requests.is_empty() {
            return;
        }
        for request in &mut self.requests {
            request.stale = true;
        }
        self.stale_open = self.requests.len();
        self.fresh = 0;
        self.stale.before += self.unsettled;
        self.unsettled = 0;
    }

    /// Whether no request is left that could still deliver: the books are
    /// empty, or they are exact, hold no stale request and owe nothing
    /// (every request open was filled).
    pub(crate) fn all_ended(&self) -> bool {
        self.requests.is_empty() || (self.exact && self.stale_open == 0 && self.owed() == 0)
    }

    /// Whether a request sent since the last reconnect still owes messages:
    /// then the server must keep talking (messages or heartbeats).
    pub(crate) fn expects_word(&self) -> bool {
        self.owed() > 0
    }

    /// When the next request leaves the books if no status comes.
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.requests
            .front()
            .map(|request| request.expires_at + EXPIRY_MARGIN)
    }

    /// How many requests are on the books.
    pub(crate) fn open(&self) -> usize {
        self.requests.len()
    }

    /// Forgets every request, once the books can only be wrong: the pull
    /// ended without reading their ends.
    pub(crate) fn clear(&mut self) {
        self.requests.clear();
        self.emptied();
    }

    /// Where request `id` is on the books (ids grow in their order).
    fn position(&self, id: u64) -> Option<usize> {
        self.requests
            .binary_search_by_key(&id, |request| request.id)
            .ok()
    }

    /// Takes the request at `index` off the books, and its size off the
    /// sums.
    fn take(&mut self, index: usize) -> Request {
        let request = self.requests.remove(index).expect("a request on the books");
        self.all -= request.size;
        if request.stale {
            self.stale_open -= 1;
        } else {
            self.fresh -= request.size;
        }
        request
    }

    fn pop_front(&mut self) -> Request {
        self.take(0)
    }

    /// Credits an ended request with the `delivered` messages it reported.
    fn credit(&mut self, delivered: usize) {
        if delivered > self.unsettled {
            // More than arrived: a count the books cannot place.
            self.unsettled = 0;
            self.exact = false;
        } else {
            self.unsettled -= delivered;
        }
    }

    fn end_stale(&mut self, request: &Request, end: End) {
        match end {
            End::Left(left) => self.stale.reported += request.size.saturating_sub(left),
            End::Refused => {}
            End::Unknown | End::LeaderChanged => self.stale.unknown = true,
        }
        if self.stale_open > 0 {
            return;
        }
        // The last stale request ended: what they delivered since the
        // reconnect is in `unsettled`, and known if each reported it.
        let stale = std::mem::take(&mut self.stale);
        if stale.unknown || stale.reported < stale.before {
            self.exact = false;
        } else {
            self.credit(stale.reported - stale.before);
        }
    }

    /// No request is open: nothing can be owed, and the count starts over.
    fn emptied(&mut self) {
        self.all = 0;
        self.fresh = 0;
        self.stale_open = 0;
        self.unsettled = 0;
        self.exact = true;
        self.stale = Stale::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFE: Duration = Duration::from_secs(2);

    fn books(batch: usize) -> (Books, Instant) {
        (Books::new(batch, None), Instant::now())
    }

    fn receive(books: &mut Books, messages: usize) {
        for _ in 0..messages {
            books.message();
        }
    }

    #[test]
    fn a_filled_request_leaves_the_books_and_one_that_expires_reports_what_it_left() {
        let (mut books, now) = books(10);
        assert!(books.wants_more());
        let first = books.sent(10, now, LIFE);
        assert_eq!((books.owed(), books.wants_more()), (10, false));
        receive(&mut books, 5);
        assert_eq!((books.owed(), books.wants_more()), (5, true));
        let second = books.sent(10, now, LIFE);
        assert_eq!(books.owed(), 15);
        // The first expires having delivered 4 (the server served both):
        // credited exactly.
        assert!(books.end(first, End::Left(6)).is_some());
        assert_eq!(books.owed(), 9);
        assert!(!books.all_ended());
        receive(&mut books, 9);
        assert_eq!(books.open(), 0, "the second was filled");
        assert!(books.all_ended());
        assert!(
            books.end(second, End::Left(0)).is_none(),
            "not on the books"
        );
    }

    #[test]
    fn each_request_ends_on_its_own_and_a_status_for_an_unknown_one_changes_nothing() {
        let (mut books, now) = books(8);
        let a = books.sent(8, now, LIFE);
        let b = books.sent(8, now, LIFE);
        receive(&mut books, 3);
        // Statuses without counts end both: the books guess,
        // and are no longer exact.
        books.end(a, End::Unknown);
        assert_eq!(books.owed(), 8, "the guess errs towards owing more");
        assert!(!books.all_ended());
        books.end(b, End::Unknown);
        assert_eq!((books.open(), books.owed()), (0, 0));
        assert!(books.all_ended(), "empty books are exact again");
        assert!(books.end(a, End::Left(0)).is_none());
        assert_eq!(books.owed(), 0);
    }

    #[test]
    fn a_leadership_change_ends_the_request_it_names_and_every_older_one() {
        let (mut books, now) = books(4);
        // Under a steady flow: filled requests wait for their expiry on the
        // books, the last two were waiting when the leader stepped down.
        let mut ids = Vec::new();
        for _ in 0..12 {
            ids.push(books.sent(4, now, LIFE));
            receive(&mut books, 3);
        }
        ids.push(books.sent(4, now, LIFE));
        ids.push(books.sent(4, now, LIFE));
        assert_eq!((books.open(), books.owed()), (14, 20));
        // The newest is told first: it and all older ones are over.
        books.end(ids[13], End::LeaderChanged);
        assert_eq!((books.open(), books.owed()), (0, 0));
        assert!(books.wants_more(), "asks the new leader at once");
        assert!(books.end(ids[12], End::LeaderChanged).is_none());
        // A request sent after the one told stays, owed what did not come.
        let a = books.sent(4, now, LIFE);
        receive(&mut books, 1);
        let b = books.sent(4, now, LIFE);
        receive(&mut books, 2);
        books.end(a, End::LeaderChanged);
        assert!(books.is_open(b));
        assert_eq!(books.owed(), 4, "the 3 that came went to the older one");
        assert!(!books.all_ended(), "no longer exact");
    }

    #[test]
    fn a_refused_request_owes_nothing() {
        let (mut books, now) = books(8);
        let a = books.sent(8, now, LIFE);
        books.end(a, End::Refused);
        assert_eq!((books.open(), books.owed()), (0, 0));
        assert!(books.wants_more());
    }

    #[test]
    fn a_request_past_its_expiry_leaves_the_books_by_itself() {
        let (mut books, now) = books(8);
        // Dropped by the server without a word (its wait list was full).
        let a = books.sent(8, now, LIFE);
        assert_eq!(books.next_expiry(), Some(now + LIFE + EXPIRY_MARGIN));
        assert_eq!(books.expire(now + LIFE), 0, "not before the margin");
        assert!(!books.wants_more());
        assert_eq!(books.expire(now + LIFE + EXPIRY_MARGIN), 1, "lost");
        assert!(!books.is_open(a));
        assert!(books.wants_more());
        assert!(books.all_ended());
    }

    #[test]
    fn overlapping_filled_requests_are_credited_when_they_expire() {
        let (mut books, now) = books(8);
        books.sent(8, now, LIFE);
        receive(&mut books, 4);
        let later = now + Duration::from_millis(500);
        books.sent(8, later, LIFE);
        receive(&mut books, 8);
        // 12 of 16 came; the server served both, neither provably filled.
        assert_eq!((books.open(), books.owed()), (2, 4));
        assert_eq!(books.expire(now + LIFE + EXPIRY_MARGIN), 0, "as filled");
        assert_eq!((books.open(), books.owed()), (1, 4));
        assert!(!books.all_ended());
        receive(&mut books, 4);
        assert_eq!(books.open(), 0);
    }

    #[test]
    fn after_a_reconnect_old_requests_owe_nothing_but_stay_on_the_books() {
        let (mut books, now) = books(8);
        let old = books.sent(8, now, LIFE);
        receive(&mut books, 2);
        books.reconnected();
        assert_eq!(books.owed(), 0, "the old request no longer counts");
        assert!(books.wants_more());
        assert!(!books.all_ended(), "closing still waits for it");
        assert!(!books.expects_word());
        let new = books.sent(8, now, LIFE);
        // The old request was alive: it delivers its 6 more, the new one 3.
        receive(&mut books, 9);
        assert_eq!(
            books.owed(),
            0,
            "what the old one delivers is taken as it comes"
        );
        books.end(old, End::Left(0));
        // Reconciled: 8 reported, 2 before the reconnect, so 6 of the 9
        // since were the old one's.
        assert_eq!(books.owed(), 5);
        assert!(!books.all_ended());
        receive(&mut books, 5);
        assert!(!books.is_open(new), "filled");
        assert!(books.all_ended());
    }

    #[test]
    fn stale_requests_that_a_restarted_server_forgot_expire_and_leave_the_books_inexact() {
        let (mut books, now) = books(8);
        books.sent(8, now, LIFE);
        books.reconnected();
        let later = now + Duration::from_millis(100);
        books.sent(8, later, LIFE);
        receive(&mut books, 2);
        books.expire(now + LIFE + EXPIRY_MARGIN);
        assert_eq!(books.open(), 1);
        assert_eq!(books.owed(), 6);
        receive(&mut books, 6);
        // Not provably filled (the stale one's deliveries were unknown):
        // it stays until it expires.
        assert_eq!(books.open(), 1);
        assert!(!books.all_ended());
        books.expire(later + LIFE + EXPIRY_MARGIN);
        assert!(books.all_ended());
    }

    #[test]
    fn set_batch_sizes_the_next_requests_and_the_open_ones_keep_theirs() {
        let (mut books, now) = books(16);
        books.sent(books.size(), now, LIFE);
        assert_eq!(books.owed(), 16);
        books.set_batch(4);
        assert_eq!(books.size(), 4);
        // Nothing more is asked until the 16 owed fall to half the new size.
        receive(&mut books, 13);
        assert_eq!((books.owed(), books.wants_more()), (3, false));
        receive(&mut books, 1);
        assert_eq!((books.owed(), books.wants_more()), (2, true));
        books.sent(books.size(), now, LIFE);
        assert_eq!(books.owed(), 6);
        books.set_batch(0);
        assert_eq!(books.size(), 1, "at least one");
        books.set_batch(64);
        assert!(books.wants_more(), "a larger size asks again at once");
        assert_eq!(books.size(), 64);
    }

    #[test]
    fn the_cap_bounds_each_request() {
        let mut books = Books::new(16, Some(8));
        assert_eq!(
            (books.size(), books.wanted(), books.capped()),
            (8, 16, true)
        );
        books.set_batch(4);
        assert!(!books.capped());
        books.set_cap(2);
        assert_eq!((books.size(), books.capped()), (2, true));
        let books = Books::new(16, Some(0));
        assert_eq!((books.size(), books.capped()), (16, false), "0: no cap");
    }
}
