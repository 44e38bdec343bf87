//! `idem dead-letters list|show|replay|discard`.

use async_nats::jetstream;
use base64::Engine;
use idem_runtime::dead_letter::{self, DeadLetter, DeadLetterError, ReplayError, ReplayOptions};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value, json};

use crate::args::{FilterArgs, Target};
use crate::output::{self, CliError, Report, ago, or_dash, rfc3339_exact, shorten};

/// `idem dead-letters list`.
pub async fn list(
    js: &jetstream::Context,
    stream: &str,
    filter: &FilterArgs,
) -> Result<Report, CliError> {
    let letters = dead_letter::list(js, stream, &filter.filter())
        .await
        .map_err(read_error)?;
    let json = Value::Array(letters.iter().map(summary).collect());
    let text = if letters.is_empty() {
        format!(
            "no dead letters in `{stream}`{}",
            if filter.is_set() {
                " pass these filters"
            } else {
                ""
            }
        )
    } else {
        let mut table = output::table([
            "SEQ",
            "DEAD-LETTERED",
            "HANDLER",
            "FAILURE",
            "MESSAGE ID",
            "DELIVERED",
            "ERROR",
        ]);
        for letter in &letters {
            table.add_row([
                letter.sequence.to_string(),
                ago(letter.stored_at),
                or_dash(letter.handler()),
                or_dash(letter.failure()),
                or_dash(letter.message_id().map(|id| shorten(id, 40))),
                or_dash(letter.delivered()),
                or_dash(letter.error().map(|error| shorten(error, 60))),
            ]);
        }
        let mut text = output::render(&table);
        if filter.limit == Some(letters.len()) {
            text.push_str("\n(the oldest, up to --limit; there may be more)");
        }
        text
    };
    Ok(Report::done(json, text))
}

/// `idem dead-letters show <seq>`.
pub async fn show(
    js: &jetstream::Context,
    stream: &str,
    sequence: u64,
) -> Result<Report, CliError> {
    let letter = dead_letter::get(js, stream, sequence)
        .await
        .map_err(read_error)?;
    let mut json = summary(&letter);
    let mut headers = Map::new();
    for (name, values) in letter.headers.iter() {
        let values: Vec<Value> = values
            .iter()
            .map(|value| Value::from(value.as_str()))
            .collect();
        headers.insert(name.to_string(), Value::Array(values));
    }
    json["headers"] = Value::Object(headers);
    let payload_text = std::str::from_utf8(&letter.payload).ok();
    match payload_text {
        Some(text) => json["payload"] = Value::from(text),
        None => {
            json["payload_base64"] =
                Value::from(base64::engine::general_purpose::STANDARD.encode(&letter.payload))
        }
    }
    // What did not fit in the dead letter, and where it is.
    let mut moved_notes = Vec::new();
    for (what, part) in [
        ("payload", letter.payload_moved()),
        ("header block", letter.headers_moved()),
    ] {
        if let Some(part) = part {
            moved_notes.push(format!(
                "its original {what} ({} bytes) did not fit and was moved to object `{}` of object store bucket `{}` (`nats object get {} '{}'` reads it; a replay sends it, a discard deletes it)",
                or_dash(part.bytes),
                part.object,
                part.bucket,
                part.bucket,
                part.object
            ));
        }
    }
    if let Some(cut) = letter.error_cut() {
        moved_notes.push(format!(
            "{cut} bytes of its error text were cut to make it fit"
        ));
    }

    let mut table = output::table(["HEADER", "VALUE"]);
    let mut names: Vec<(String, String)> = letter
        .headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.to_string(), value.as_str().to_owned()))
        })
        .collect();
    // The Idem-* context first, then the original's own headers.
    names.sort_by(|(a, _), (b, _)| (!a.starts_with("Idem-"), a).cmp(&(!b.starts_with("Idem-"), b)));
    for (name, value) in names {
        table.add_row([name, value]);
    }
    let moved = if moved_notes.is_empty() {
        String::new()
    } else {
        format!("\n\n{}", moved_notes.join("\n"))
    };
    let text = format!(
        "dead letter {sequence} of `{stream}`, stored under {} {}\n\n{}{moved}\n\npayload ({} bytes{}):\n{}",
        letter.subject,
        ago(letter.stored_at),
        output::render(&table),
        letter.payload.len(),
        if letter.payload_moved().is_some() {
            ", the original's was moved: see above"
        } else if payload_text.is_some() {
            ""
        } else {
            ", not UTF-8, in base64"
        },
        payload_text.map_or_else(
            || base64::engine::general_purpose::STANDARD.encode(&letter.payload),
            str::to_owned
        ),
    );
    Ok(Report::done(json, text))
}

/// What `replay` does with it.
pub struct ReplaySettings {
    /// Publish nothing.
    pub dry_run: bool,
    /// Delete each dead letter once its replay is stored.
    pub discard: bool,
    /// The runtime's safety overrides.
    pub options: ReplayOptions,
}

/// `idem dead-letters replay`.
pub async fn replay(
    js: &jetstream::Context,
    stream: &str,
    target: &Target,
    settings: ReplaySettings,
) -> Result<Report, CliError> {
    let (letters, mut outcomes) = select(js, stream, target).await?;
    let progress = progress(letters.len(), "replaying", settings.dry_run);
    let mut replayed = 0;
    for letter in &letters {
        let mut outcome = summary(letter);
        let result = if settings.dry_run {
            dead_letter::check_replay(letter, &settings.options).map(|()| None)
        } else {
            dead_letter::replay_with(js, stream, letter.sequence, settings.options.clone())
                .await
                .map(Some)
        };
        match result {
            Ok(None) => {
                replayed += 1;
                outcome["outcome"] = Value::from("would-replay");
            }
            Ok(Some(ack)) => {
                outcome["outcome"] = Value::from("replayed");
                outcome["replayed_to"] = json!({ "stream": ack.stream, "sequence": ack.sequence });
                if !settings.discard {
                    replayed += 1;
                } else {
                    match dead_letter::discard(js, stream, letter.sequence).await {
                        Ok(()) => {
                            replayed += 1;
                            outcome["discarded"] = Value::from(true);
                        }
                        // Replayed all the same: a later replay of it is
                        // refused in the window, or skipped by its claim.
                        Err(error) => {
                            outcome["discarded"] = Value::from(false);
                            outcome["reason"] =
                                Value::from(format!("replayed, but not discarded: {error}"));
                        }
                    }
                }
            }
            Err(error) => {
                outcome["outcome"] = Value::from(refusal_kind(&error));
                outcome["reason"] = Value::from(error.to_string());
            }
        }
        outcomes.push(outcome);
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(bulk_report(
        outcomes,
        replayed,
        if settings.dry_run {
            "would be replayed"
        } else {
            "replayed"
        },
        "replay",
        settings.dry_run,
    ))
}

/// `idem dead-letters discard`.
pub async fn discard(
    js: &jetstream::Context,
    stream: &str,
    target: &Target,
    dry_run: bool,
) -> Result<Report, CliError> {
    let (letters, mut outcomes) = select(js, stream, target).await?;
    let progress = progress(letters.len(), "discarding", dry_run);
    let mut discarded = 0;
    for letter in &letters {
        let mut outcome = summary(letter);
        let result = if dry_run {
            Ok(())
        } else {
            dead_letter::discard(js, stream, letter.sequence).await
        };
        match result {
            Ok(()) => {
                discarded += 1;
                outcome["outcome"] = Value::from(if dry_run {
                    "would-discard"
                } else {
                    "discarded"
                });
            }
            Err(error) => {
                outcome["outcome"] = Value::from("failed");
                outcome["reason"] = Value::from(error.to_string());
            }
        }
        outcomes.push(outcome);
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(bulk_report(
        outcomes,
        discarded,
        if dry_run {
            "would be discarded"
        } else {
            "discarded"
        },
        "discard",
        dry_run,
    ))
}

/// The dead letters a `replay` or `discard` acts on, and the outcomes of
/// sequences that could not be read (already discarded, say).
async fn select(
    js: &jetstream::Context,
    stream: &str,
    target: &Target,
) -> Result<(Vec<DeadLetter>, Vec<Value>), CliError> {
    if !target.sequences.is_empty() {
        if target.filter.is_set() || target.filter.limit.is_some() {
            return Err(CliError::usage(
                "sequences and filters cannot be combined",
                "name the dead letters by sequence, or select them with filters (--handler, --failure, --since, --until, --subject, --limit)",
            ));
        }
        let mut letters = Vec::new();
        let mut missing = Vec::new();
        for &sequence in &target.sequences {
            match dead_letter::get(js, stream, sequence).await {
                Ok(letter) => letters.push(letter),
                Err(
                    error @ (DeadLetterError::NotFound { .. }
                    | DeadLetterError::NotADeadLetter { .. }),
                ) => missing.push(json!({
                    "sequence": sequence,
                    "outcome": "not-found",
                    "reason": error.to_string(),
                })),
                Err(error) => return Err(read_error(error)),
            }
        }
        return Ok((letters, missing));
    }
    if !target.all && !target.filter.is_set() {
        return Err(CliError::usage(
            "which dead letters? none were named",
            "give their sequences (from `idem dead-letters list`), or filters (--handler, --failure, --since, --until, --subject), or --all for every one",
        ));
    }
    let letters = dead_letter::list(js, stream, &target.filter.filter())
        .await
        .map_err(read_error)?;
    Ok((letters, Vec::new()))
}

/// A progress bar on stderr (drawn only on a terminal).
fn progress(len: usize, verb: &str, dry_run: bool) -> ProgressBar {
    let bar = ProgressBar::new(len as u64).with_message(if dry_run {
        format!("checking (dry run, {verb} nothing)")
    } else {
        verb.to_owned()
    });
    bar.set_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// The report of a bulk `replay` or `discard`: a table of outcomes, and
/// incomplete (exit 1) unless every selected dead letter was done.
fn bulk_report(outcomes: Vec<Value>, done: usize, did: &str, verb: &str, dry_run: bool) -> Report {
    let total = outcomes.len();
    let mut table = output::table(["SEQ", "HANDLER", "MESSAGE ID", "OUTCOME"]);
    let mut reasons = Vec::new();
    for outcome in &outcomes {
        let cell = |key: &str| {
            outcome
                .get(key)
                .and_then(|value| match value {
                    Value::String(text) => Some(text.clone()),
                    Value::Null => None,
                    other => Some(other.to_string()),
                })
                .unwrap_or_else(|| "-".to_owned())
        };
        table.add_row([
            cell("sequence"),
            cell("handler"),
            shorten(&cell("message_id"), 40),
            cell("outcome"),
        ]);
        if outcome.get("reason").is_some() {
            reasons.push(format!("{}: {}", cell("sequence"), cell("reason")));
        }
    }
    let summary = format!(
        "{done} of {total} {did}{}",
        if dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    );
    let text = if total == 0 {
        format!("no dead letters selected: nothing to {verb}")
    } else {
        let mut text = output::render(&table);
        if !reasons.is_empty() {
            text.push_str("\n\n");
            text.push_str(&reasons.join("\n"));
        }
        format!("{text}\n\n{summary}")
    };
    let incomplete = (done < total).then(|| {
        CliError::new(
            format!("{} of {total} dead letters were not {did}", total - done),
            if verb == "replay" {
                "see each one's reason and fix its cause; a refused dead letter was not published and stays in its stream (one refused as a duplicate was replayed less than its stream's duplicate window ago, and that replay is stored)"
            } else {
                "see each one's reason; the others stay in their stream"
            },
        )
    });
    let mut json = json!({
        "dry_run": dry_run,
        "selected": total,
        "done": done,
        "dead_letters": outcomes,
    });
    // `replayed` or `discarded`, as well as `done`, for readable scripts.
    json[if verb == "replay" {
        "replayed"
    } else {
        "discarded"
    }] = Value::from(done);
    Report {
        json,
        text,
        incomplete,
    }
}

/// A refused replay's outcome, for scripts.
fn refusal_kind(error: &ReplayError) -> &'static str {
    match error {
        ReplayError::InsideDuplicateWindow => "refused-duplicate",
        ReplayError::NoMessageId(_) => "refused-no-message-id",
        ReplayError::OutsideRetention { .. } => "refused-outside-retention",
        ReplayError::NotADeadLetter(_) => "refused-not-a-dead-letter",
        ReplayError::TooLarge { .. } => "refused-too-large",
        ReplayError::NoRouteForHandler { .. } => "refused-no-route",
        ReplayError::NoStreamForSubject { .. } => "refused-no-stream",
        _ => "failed",
    }
}

/// A dead letter for `list` and the bulk commands.
fn summary(letter: &DeadLetter) -> Value {
    json!({
        "sequence": letter.sequence,
        "stream": letter.stream,
        "subject": letter.subject,
        "stored_at": rfc3339_exact(letter.stored_at),
        "handler": letter.handler(),
        "failure": letter.failure(),
        "error": letter.error(),
        "message_id": letter.message_id(),
        "message_id_source": letter.header("Idem-Message-Id-Source"),
        "original_subject": letter.original_subject(),
        "original_stream": letter.original_position().map(|(stream, _)| stream),
        "original_sequence": letter.original_position().map(|(_, sequence)| sequence),
        "delivered": letter.delivered(),
        "dead_lettered_at": letter.header("Idem-Dead-Lettered-At"),
        "replayed_from": letter.replayed_from(),
        "payload_bytes": letter.payload.len(),
        "payload_moved": moved(letter.payload_moved()),
        "headers_moved": moved(letter.headers_moved()),
        "error_cut": letter.error_cut(),
    })
}

/// A part moved out of a dead letter, for `--json`; `null` if none.
fn moved(part: Option<dead_letter::MovedPart>) -> Value {
    part.map_or(
        Value::Null,
        |part| json!({ "bucket": part.bucket, "object": part.object, "bytes": part.bytes }),
    )
}

fn read_error(error: DeadLetterError) -> CliError {
    match error {
        DeadLetterError::NotFound { .. } | DeadLetterError::NotADeadLetter { .. } => CliError::new(
            error.to_string(),
            "`idem dead-letters list` shows the dead letters and their sequences",
        ),
        other => CliError::plain(other.to_string()),
    }
}
