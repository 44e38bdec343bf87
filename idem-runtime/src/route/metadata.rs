//! What a route records on its consumer, in the consumer's metadata: its
//! retention and the copies term of its floor, for its dead letters to copy
//! (see [`dead_letter`](crate::dead_letter)); its handler, its
//! dead-letter subject and the size of its pull requests, for operators
//! ([`status::consumers`](crate::status::consumers)).

use crate::error::retention::{RetentionFloor, encode_duration};
use crate::route::Route;

/// The prefix of every consumer metadata key a route writes.
pub(crate) const PREFIX: &str = "idem.";

/// The prefix of the consumer metadata keys the NATS server writes itself.
pub(crate) const SERVER_PREFIX: &str = "_nats.";

/// The consumer metadata key under which a route records its retention
/// (`forever`, or seconds: `604800s`), for its dead letters to copy.
pub(crate) const RETENTION_KEY: &str = "idem.retention";

/// The consumer metadata key under which a route records how far apart in
/// time copies of one message may be stored (the publisher-copies term),
/// when it is not zero.
pub(crate) const COPY_SPREAD_KEY: &str = "idem.copy_spread";

/// The consumer metadata key under which a route records its handler's name.
pub(crate) const HANDLER_KEY: &str = "idem.handler";

/// The consumer metadata key under which a route records its dead-letter
/// subject.
pub(crate) const DEAD_LETTERS_KEY: &str = "idem.dead_letters";

/// The consumer metadata key under which a route records how many messages
/// each of its pull requests asks for (concurrency × batch), for `idem
/// status` to tell when the consumer's `max_batch` caps it.
pub(crate) const PULL_BATCH_KEY: &str = "idem.pull_batch";

/// The metadata `route`, running `handler`, records on its consumer.
pub(crate) fn consumer_metadata(
    route: &Route,
    handler: &str,
    floor: &RetentionFloor,
) -> Vec<(String, String)> {
    let mut metadata = vec![(
        RETENTION_KEY.to_owned(),
        route
            .retention
            .map_or_else(|| "forever".to_owned(), encode_duration),
    )];
    let spread = floor.copy_spread();
    if route.retention.is_some() && !spread.is_zero() {
        metadata.push((COPY_SPREAD_KEY.to_owned(), encode_duration(spread)));
    }
    metadata.push((HANDLER_KEY.to_owned(), handler.to_owned()));
    metadata.push((DEAD_LETTERS_KEY.to_owned(), route.dead_letter_target()));
    metadata.push((
        PULL_BATCH_KEY.to_owned(),
        (route.concurrency * route.batch_cap()).to_string(),
    ));
    metadata
}
