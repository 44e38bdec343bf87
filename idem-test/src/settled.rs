//! Step 6: assertions about a settled run, on your tables and on idem's
//! side. Each panics with the run's report when it fails: which faults
//! ran, what showed each one, and the messages they touched.

use std::fmt;
use std::sync::Arc;

use async_nats::jetstream;
use sqlx::Connection;

use crate::bed::{Bed, block_on};
use crate::report::{RunReport, list};

/// A run that has settled: nothing pending, every fault shown to have
/// happened, the routers stopped. State what must hold with its
/// `assert_*` methods, which chain:
///
/// ```no_run
/// # async fn demo(run: idem_test::Run<'_>) {
/// run.until_settled()
///     .await
///     .assert_effects("SELECT count(*) FROM ledger_entries", 500)
///     .assert_no_duplicates("SELECT transfer_id FROM ledger_entries")
///     .assert_sum("SELECT sum(balance) FROM accounts", 24_750)
///     .assert_claims("ledger.credit.v1", 500)
///     .assert_no_dead_letters();
/// # }
/// ```
///
/// Each assertion runs on a thread of its own, so it works under any
/// runtime. `Display` shows the run's report.
pub struct Settled<'b> {
    bed: &'b Bed,
    report: Arc<RunReport>,
    streams: Vec<String>,
    captures: Vec<String>,
}

impl<'b> Settled<'b> {
    pub(crate) fn new(
        bed: &'b Bed,
        report: RunReport,
        routes: Vec<(String, String)>,
        captures: Vec<String>,
    ) -> Settled<'b> {
        let mut streams: Vec<String> = routes.into_iter().map(|(stream, _)| stream).collect();
        streams.sort_unstable();
        streams.dedup();
        Settled {
            bed,
            report: Arc::new(report),
            streams,
            captures,
        }
    }

    /// Asserts that `sql`, a query of one row and one number (a count of
    /// your effects, typically), returns `expected`: one effect per unique
    /// input, whatever was delivered twice.
    ///
    /// # Panics
    ///
    /// If it returns another number (NULL counts as 0), or fails.
    pub fn assert_effects(&self, sql: &str, expected: i64) -> &Self {
        self.assert_number("effects", sql, expected)
    }

    /// Asserts that `sql`, a query of one row and one number (a sum of
    /// balances, say), returns `expected`.
    ///
    /// # Panics
    ///
    /// If it returns another number (NULL counts as 0), or fails.
    pub fn assert_sum(&self, sql: &str, expected: i64) -> &Self {
        self.assert_number("sum", sql, expected)
    }

    fn assert_number(&self, what: &str, sql: &str, expected: i64) -> &Self {
        let url = self.bed.database_url().to_owned();
        let query = format!("SELECT coalesce(({sql})::bigint, 0)");
        let found: Result<i64, String> = block_on(async move {
            let mut db = sqlx::PgConnection::connect(&url)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query_scalar(sqlx::AssertSqlSafe(query))
                .fetch_one(&mut db)
                .await
                .map_err(|e| e.to_string())
        });
        match found {
            Ok(found) if found == expected => self,
            Ok(found) => {
                let off = if found > expected {
                    format!("{} more", found - expected)
                } else {
                    format!("{} fewer", expected - found)
                };
                panic!(
                    "{}",
                    self.report.failure(&format!(
                        "{what} `{sql}` is {found}, expected {expected} ({off})"
                    ))
                )
            }
            Err(error) => panic!("idem-test: {what} query `{sql}` failed: {error}"),
        }
    }

    /// Asserts that no value of `sql`'s one column occurs twice: one
    /// effect per key. A key that does is listed with the faults that
    /// touched the message of that id, where the key is a message id.
    ///
    /// # Panics
    ///
    /// If a key occurs more than once, or the query fails.
    pub fn assert_no_duplicates(&self, sql: &str) -> &Self {
        let url = self.bed.database_url().to_owned();
        let query = format!(
            "SELECT k::text, count(*) FROM ({sql}) AS t(k) GROUP BY 1 HAVING count(*) > 1 ORDER BY 1"
        );
        let found: Result<Vec<(Option<String>, i64)>, String> = block_on(async move {
            let mut db = sqlx::PgConnection::connect(&url)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query_as(sqlx::AssertSqlSafe(query))
                .fetch_all(&mut db)
                .await
                .map_err(|e| e.to_string())
        });
        let doubled = match found {
            Ok(doubled) if doubled.is_empty() => return self,
            Ok(doubled) => doubled,
            Err(error) => panic!("idem-test: query `{sql}` failed: {error}"),
        };
        let keys: Vec<String> = doubled
            .iter()
            .map(|(key, n)| {
                let key = key.clone().unwrap_or_else(|| "NULL".to_owned());
                match self.report.story_of(&key) {
                    None => format!("{key} ({n} times)"),
                    Some(story) => format!("{key} ({n} times; {story})"),
                }
            })
            .collect();
        panic!(
            "{}",
            self.report.failure(&format!(
                "`{sql}` has {} keys more than once: {}",
                keys.len(),
                list(&keys, 10)
            ))
        )
    }

    /// Asserts that handler `handler` (its pinned name) holds `expected`
    /// claims: one per message it processed.
    ///
    /// # Panics
    ///
    /// If it holds another number.
    pub fn assert_claims(&self, handler: &str, expected: i64) -> &Self {
        let url = self.bed.database_url().to_owned();
        let name = handler.to_owned();
        let found: Result<i64, String> = block_on(async move {
            let mut db = sqlx::PgConnection::connect(&url)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query_scalar("SELECT count(*) FROM idem_processed WHERE handler = $1")
                .bind(name)
                .fetch_one(&mut db)
                .await
                .map_err(|e| e.to_string())
        });
        match found {
            Ok(found) if found == expected => self,
            Ok(found) => panic!(
                "{}",
                self.report.failure(&format!(
                    "handler {handler} holds {found} claims, expected {expected}"
                ))
            ),
            Err(error) => panic!("idem-test: cannot count the claims of {handler}: {error}"),
        }
    }

    /// Asserts that no message of the run's streams was dead-lettered,
    /// besides those [`Fault::DeadLetterReplay`](crate::Fault) caused and
    /// replayed.
    ///
    /// # Panics
    ///
    /// If one was; the message lists each with its handler, message id,
    /// failure and error.
    pub fn assert_no_dead_letters(&self) -> &Self {
        let url = self.bed.nats_url().to_owned();
        let streams = self.streams.clone();
        let letters: Result<Vec<String>, String> = block_on(async move {
            let js = jetstream::new(async_nats::connect(&url).await.map_err(|e| e.to_string())?);
            if js
                .get_stream_no_info(idem_runtime::dead_letter::DEFAULT_STREAM)
                .await
                .is_err()
            {
                return Ok(Vec::new());
            }
            let letters = idem_runtime::dead_letter::list(
                &js,
                idem_runtime::dead_letter::DEFAULT_STREAM,
                &idem_runtime::dead_letter::Filter::new(),
            )
            .await
            .map_err(|e| e.to_string())?;
            Ok(letters
                .iter()
                .filter(|letter| {
                    letter
                        .header("Idem-Original-Stream")
                        .is_none_or(|stream| streams.iter().any(|s| s == stream))
                })
                .map(|letter| {
                    format!(
                        "#{} {} of {} ({}): {}",
                        letter.sequence,
                        letter.message_id().unwrap_or("(no id)"),
                        letter.handler().unwrap_or("(no handler)"),
                        letter.failure().unwrap_or("?"),
                        letter.error().unwrap_or("")
                    )
                })
                .collect())
        });
        match letters {
            Ok(letters) if letters.is_empty() => self,
            Ok(letters) => panic!(
                "{}",
                self.report.failure(&format!(
                    "{} messages were dead-lettered:\n    {}",
                    letters.len(),
                    letters.join("\n    ")
                ))
            ),
            Err(error) => panic!("idem-test: cannot read the dead letters: {error}"),
        }
    }

    /// Asserts that `subject` (a wildcard may be used) holds `expected`
    /// distinct messages, each published once: two stored copies of one
    /// payload count as one message only when they carry the same
    /// `Nats-Msg-Id` (an outbox relay's republish, which consumers
    /// deduplicate); two without one, or with two ids, are a message sent
    /// twice. Replays of dead letters are not counted. Messages are read
    /// from the stream that stores the subject (see
    /// [`Run::capture`](crate::Run::capture) for a subject no stream of
    /// yours stores).
    ///
    /// # Panics
    ///
    /// If a payload was sent twice, or the count differs.
    pub fn assert_published_once(&self, subject: &str, expected: usize) -> &Self {
        let url = self.bed.nats_url().to_owned();
        let pattern = subject.to_owned();
        let read: Result<Vec<(bytes::Bytes, Option<String>)>, String> =
            block_on(async move { read_subject(&url, &pattern).await });
        let messages = read.unwrap_or_else(|error| {
            panic!(
                "idem-test: cannot read the messages on {subject}: {error}{}",
                if self.captures.iter().any(|c| c == subject) {
                    ""
                } else {
                    " (Run::capture keeps a subject no stream stores)"
                }
            )
        });
        let mut by_payload: std::collections::BTreeMap<&[u8], Vec<Option<&str>>> =
            std::collections::BTreeMap::new();
        for (payload, id) in &messages {
            by_payload
                .entry(payload.as_ref())
                .or_default()
                .push(id.as_deref());
        }
        let twice: Vec<String> = by_payload
            .iter()
            .filter(|(_, ids)| {
                let first = ids[0];
                ids.len() > 1 && (first.is_none() || ids.iter().any(|id| *id != first))
            })
            .map(|(payload, ids)| {
                format!(
                    "{} ({} copies, ids {:?})",
                    String::from_utf8_lossy(payload),
                    ids.len(),
                    ids
                )
            })
            .collect();
        if twice.is_empty() && by_payload.len() == expected {
            return self;
        }
        let what = if twice.is_empty() {
            format!(
                "{subject} holds {} distinct messages, expected {expected}",
                by_payload.len()
            )
        } else {
            format!(
                "{subject} holds {} messages sent more than once: {}",
                twice.len(),
                list(&twice, 5)
            )
        };
        panic!("{}", self.report.failure(&what))
    }

    /// Asserts that every request of [`Run::request_json`](crate::Run::request_json)
    /// was answered, and that every answer to one request is the same,
    /// byte for byte: its retries, after a lost reply or an answer, got
    /// what its first run stored.
    ///
    /// # Panics
    ///
    /// If a request got no answer, was refused, or got two different ones.
    pub fn assert_replies_identical(&self) -> &Self {
        let mut wrong = Vec::new();
        for (id, log) in &self.report.requests {
            if log.answers.is_empty() || log.refused {
                wrong.push(format!(
                    "{id} on {}: no answer after {} sends ({})",
                    log.subject,
                    log.sent,
                    log.errors.last().map_or("", String::as_str)
                ));
            } else if log.answers.iter().any(|a| *a != log.answers[0]) {
                let answers: Vec<String> = log
                    .answers
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                wrong.push(format!(
                    "{id} on {}: answers differ: {}",
                    log.subject,
                    answers.join(" / ")
                ));
            }
        }
        if wrong.is_empty() {
            return self;
        }
        panic!(
            "{}",
            self.report.failure(&format!(
                "{} requests were not answered alike: {}",
                wrong.len(),
                list(&wrong, 5)
            ))
        )
    }
}

impl fmt::Display for Settled<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.report.fmt(f)
    }
}

/// Every message stored on `pattern`, as (payload, `Nats-Msg-Id`), from
/// the stream that stores it, dead-letter replays left out.
async fn read_subject(
    url: &str,
    pattern: &str,
) -> Result<Vec<(bytes::Bytes, Option<String>)>, String> {
    let js = jetstream::new(async_nats::connect(url).await.map_err(|e| e.to_string())?);
    let name = js
        .stream_by_subject(pattern)
        .await
        .map_err(|e| format!("no stream stores it ({e})"))?;
    let mut stream = js.get_stream(&name).await.map_err(|e| e.to_string())?;
    let state = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .clone();
    let mut messages = Vec::new();
    for sequence in state.first_sequence..=state.last_sequence {
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        // A dead letter's replay (an operator's resend, which only its
        // handler runs) is not a publish of the service's.
        if !subject_matches(pattern, message.subject.as_str())
            || message.headers.get("Idem-Replay-For").is_some()
        {
            continue;
        }
        let id = message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_owned());
        messages.push((message.payload, id));
    }
    Ok(messages)
}

/// Whether `subject` matches the NATS subject `pattern` (`*` one token,
/// `>` the rest).
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for want in pattern.split('.') {
        match (want, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (want, Some(token)) if want == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subjects_match_as_nats_matches_them() {
        assert!(subject_matches("orders.>", "orders.paid.eu"));
        assert!(subject_matches("orders.*", "orders.paid"));
        assert!(!subject_matches("orders.*", "orders.paid.eu"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders.paid", "orders.paid"));
        assert!(!subject_matches("orders.paid", "orders.placed"));
    }
}
