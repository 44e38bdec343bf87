//! Per-key ordering: a stream's subjects split into partitions by key, and
//! one route per partition that applies its messages one at a time.
//!
//! Several workers, or a concurrency above 1, apply a consumer's messages in
//! no particular order. Where one key's messages must be applied in publish
//! order (an account's debits and credits, an order's state changes), let
//! JetStream assign each key to a partition when it stores the message (the
//! stream's `subject_transform` with `{{partition(n, ...)}}`, a hash of the
//! key tokens), and give each partition a durable consumer of its own that
//! hands out one message at a time (`max_ack_pending` 1, `concurrency` 1).
//! The next message of a partition is delivered only after the previous one
//! is committed and acked (or its redelivery is), by whichever worker takes
//! it. Partitions proceed in parallel, spread over the workers.
//!
//! A dead letter of a partitioned route records the subject its original
//! was stored under (`<prefix>.<partition>.<key>`), which the stream does
//! not capture. Its replay goes to the subject it was published to,
//! recovered from the stream's transform (`published_subject`): the
//! stream stores it in the key's partition again.

use async_nats::jetstream::stream;

use crate::route::Route;

/// Subjects split into `count` partitions by their wildcard tokens (the
/// key), and the routes that apply each partition in order.
///
/// Messages are published to `source` (e.g. `orders.*`, the key being the
/// `*` token) and stored as `<prefix>.<partition>.<key tokens>`, e.g.
/// `orders.p.3.order-17`; one durable consumer reads each partition.
///
/// ```
/// use idem_runtime::route::partition::Partitions;
///
/// let partitions = Partitions::new("orders.*", 4);
/// let stream = partitions.stream_config("ORDERS");
/// let transform = stream.subject_transform.as_ref().unwrap();
/// assert_eq!(transform.source, "orders.*");
/// assert_eq!(transform.destination, "orders.p.{{partition(4,1)}}.{{wildcard(1)}}");
///
/// let routes = partitions.routes("ORDERS", "orders-apply");
/// assert_eq!(routes.len(), 4);
/// assert_eq!(routes[3].durable_name(), "orders-apply-p3");
/// ```
///
/// and each route is bound to the same handler (one handler name: the
/// partitions share its dedup rows, as one consumer would):
///
/// ```no_run
/// # use idem_runtime::{Router, idempotent, route::partition::Partitions};
/// # #[idempotent(name = "orders.apply.v1", codec = raw)]
/// # async fn apply(tx: &mut sqlx::PgTransaction<'_>, body: Vec<u8>) -> Result<(), sqlx::Error> { Ok(()) }
/// let partitions = Partitions::new("orders.*", 4);
/// let router = Router::new().route_partitions(partitions.routes("ORDERS", "orders-apply"), apply);
/// # drop(router);
/// ```
#[derive(Debug, Clone)]
pub struct Partitions {
    source: String,
    prefix: String,
    count: u32,
}

impl Partitions {
    /// `count` partitions of the subjects matching `source`, keyed by all of
    /// its `*` tokens. The stored subjects start with `source`'s first token
    /// and `p` (`orders.*` → `orders.p.<partition>.<key>`); see
    /// [`Partitions::stored_prefix`].
    ///
    /// # Panics
    ///
    /// If `count` is 0, or `source` has no `*` token or has a `>` (the key
    /// must be a fixed number of tokens).
    pub fn new(source: impl Into<String>, count: u32) -> Self {
        let source = source.into();
        assert!(count > 0, "a stream needs at least one partition");
        assert!(
            source.split('.').any(|token| token == "*") && !source.contains('>'),
            "the partitioned subject `{source}` must have a `*` token for the key and no `>`"
        );
        let first = source.split('.').next().unwrap_or_default();
        let prefix = format!("{first}.p");
        Self {
            source,
            prefix,
            count,
        }
    }

    /// Store messages under `prefix` instead: `<prefix>.<partition>.<key>`.
    /// It must not overlap `source`, or a stored subject could be
    /// transformed again when republished.
    pub fn stored_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many partitions there are.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The stream's subject transform: `source` to
    /// `<prefix>.{{partition(count,1,..)}}.{{wildcard(1)}}...`.
    pub fn subject_transform(&self) -> stream::SubjectTransform {
        let wildcards = self.source.split('.').filter(|token| *token == "*").count();
        let indexes: Vec<String> = (1..=wildcards).map(|i| i.to_string()).collect();
        let tokens: Vec<String> = (1..=wildcards)
            .map(|i| format!("{{{{wildcard({i})}}}}"))
            .collect();
        stream::SubjectTransform {
            source: self.source.clone(),
            destination: format!(
                "{}.{{{{partition({},{})}}}}.{}",
                self.prefix,
                self.count,
                indexes.join(","),
                tokens.join(".")
            ),
        }
    }

    /// A stream `name` that captures `source` and stores it partitioned;
    /// set the rest (replicas, limits) on the result.
    pub fn stream_config(&self, name: impl Into<String>) -> stream::Config {
        stream::Config {
            name: name.into(),
            subjects: vec![self.source.clone()],
            subject_transform: Some(self.subject_transform()),
            ..Default::default()
        }
    }

    /// The stored subjects of partition `partition`: `<prefix>.<partition>.>`.
    pub fn partition_subject(&self, partition: u32) -> String {
        format!("{}.{partition}.>", self.prefix)
    }

    /// One route per partition on `stream`: durable `<durable>-p<i>`,
    /// filtered to partition `i`, with `max_ack_pending` 1 and `concurrency`
    /// 1, so that a partition's next message is delivered only once the
    /// previous one is acked. Set other settings (ack_wait, retry) on each
    /// route; raising either limit gives up the order.
    pub fn routes(&self, stream: &str, durable: &str) -> Vec<Route> {
        (0..self.count)
            .map(|partition| {
                Route::new(stream, format!("{durable}-p{partition}"))
                    .filter_subject(self.partition_subject(partition))
                    .max_ack_pending(1)
                    .concurrency(1)
                    .partition_of(durable)
            })
            .collect()
    }
}

/// The subject a stream whose transform is `transform` stores as `stored`:
/// publishing to it stores the message as `stored` again (while the
/// partition count is the same: the partition is a hash of the key
/// tokens). `None` unless `transform` is of the form
/// [`Partitions::subject_transform`] makes (its destination's tokens
/// literal, `{{partition(..)}}` or `{{wildcard(i)}}`, its source's literal
/// or `*`) and `stored` fits it.
pub(crate) fn published_subject(
    transform: &stream::SubjectTransform,
    stored: &str,
) -> Option<String> {
    let destination: Vec<&str> = transform.destination.split('.').collect();
    let tokens: Vec<&str> = stored.split('.').collect();
    if destination.len() != tokens.len() {
        return None;
    }
    let mut wildcards: Vec<Option<&str>> = Vec::new();
    for (pattern, token) in destination.iter().zip(&tokens) {
        let Some(function) = pattern
            .strip_prefix("{{")
            .and_then(|rest| rest.strip_suffix("}}"))
        else {
            if pattern != token {
                return None;
            }
            continue;
        };
        let function = function.trim().to_ascii_lowercase();
        if function.starts_with("partition(") {
            if !token.bytes().all(|byte| byte.is_ascii_digit()) {
                return None;
            }
            continue;
        }
        let index: usize = function
            .strip_prefix("wildcard(")?
            .strip_suffix(')')?
            .trim()
            .parse()
            .ok()?;
        if index == 0 {
            return None;
        }
        if wildcards.len() < index {
            wildcards.resize(index, None);
        }
        match wildcards[index - 1] {
            Some(earlier) if earlier != *token => return None,
            _ => wildcards[index - 1] = Some(token),
        }
    }
    let mut next = 0;
    let mut published = Vec::new();
    for token in transform.source.split('.') {
        match token {
            "*" => {
                published.push(*wildcards.get(next)?.as_ref()?);
                next += 1;
            }
            ">" => return None,
            literal => published.push(literal),
        }
    }
    Some(published.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_subject_maps_back_to_the_subject_it_was_published_to() {
        let transform = Partitions::new("orders.*", 4).subject_transform();
        assert_eq!(
            published_subject(&transform, "orders.p.3.order-17").as_deref(),
            Some("orders.order-17")
        );
        let two = Partitions::new("acct.*.eu.*", 8)
            .stored_prefix("acct-by-key")
            .subject_transform();
        assert_eq!(
            published_subject(&two, "acct-by-key.5.a1.b2").as_deref(),
            Some("acct.a1.eu.b2")
        );
        // Not of the transform's form: no guess.
        assert_eq!(published_subject(&transform, "orders.p.x.order-17"), None);
        assert_eq!(published_subject(&transform, "orders.q.3.order-17"), None);
        assert_eq!(published_subject(&transform, "orders.p.3"), None);
        let other = stream::SubjectTransform {
            source: "in.*".into(),
            destination: "out.{{split(1,-)}}".into(),
        };
        assert_eq!(published_subject(&other, "out.a"), None);
    }

    #[test]
    fn a_key_of_two_tokens_is_hashed_and_kept_whole() {
        let transform = Partitions::new("acct.*.*", 8)
            .stored_prefix("acct-by-key")
            .subject_transform();
        assert_eq!(
            transform.destination,
            "acct-by-key.{{partition(8,1,2)}}.{{wildcard(1)}}.{{wildcard(2)}}"
        );
    }

    #[test]
    #[should_panic(expected = "must have a `*` token")]
    fn a_subject_without_a_key_token_is_refused() {
        Partitions::new("orders.>", 4);
    }
}
