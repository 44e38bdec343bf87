//! What a command prints, for people and for scripts, and how it fails.

use std::time::Duration;

use comfy_table::{Table, presets};
use serde_json::Value;
use time::OffsetDateTime;

/// What a command produced: a JSON document and the same as text, and
/// whether it did everything it was asked.
pub struct Report {
    /// Printed with `--json`.
    pub json: Value,
    /// Printed otherwise.
    pub text: String,
    /// Set when the command ran but did not apply to everything it
    /// selected (a refused replay, say): printed to stderr, exit 1.
    pub incomplete: Option<CliError>,
}

impl Report {
    /// A report of a command that did everything.
    pub fn done(json: Value, text: String) -> Report {
        Report {
            json,
            text,
            incomplete: None,
        }
    }
}

/// A command that failed: what happened, and what to do next.
#[derive(Debug)]
pub struct CliError {
    /// What happened.
    pub message: String,
    /// What to do about it.
    pub hint: Option<String>,
    /// A bad command line (exit 2) rather than a failed operation (exit 1).
    pub usage: bool,
}

impl CliError {
    /// An operation that failed.
    pub fn new(message: impl Into<String>, hint: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            hint: Some(hint.into()),
            usage: false,
        }
    }

    /// An operation that failed, whose message says what to do.
    pub fn plain(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            hint: None,
            usage: false,
        }
    }

    /// A command line that cannot work.
    pub fn usage(message: impl Into<String>, hint: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            hint: Some(hint.into()),
            usage: true,
        }
    }

    /// The exit code for it.
    pub fn exit_code(&self) -> u8 {
        if self.usage { 2 } else { 1 }
    }

    /// As printed to stderr.
    pub fn render(&self) -> String {
        match &self.hint {
            Some(hint) => format!("error: {}\n  hint: {hint}", self.message),
            None => format!("error: {}", self.message),
        }
    }
}

/// A table with a header row and no inner lines, like `kubectl get`.
pub fn table<const N: usize>(header: [&str; N]) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(header);
    table
}

/// A table as text, without the padding comfy-table leaves at line ends.
pub fn render(table: &Table) -> String {
    table
        .lines()
        .map(|line| line.trim_end().to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `at` in RFC 3339, to the second.
pub fn rfc3339(at: OffsetDateTime) -> String {
    at.replace_nanosecond(0)
        .unwrap_or(at)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// `at` in RFC 3339 with its fraction, for JSON.
pub fn rfc3339_exact(at: OffsetDateTime) -> String {
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A duration for people: `3m 12s`, `250ms`.
pub fn human(duration: Duration) -> String {
    let rounded = if duration >= Duration::from_secs(1) {
        Duration::from_secs(duration.as_secs())
    } else {
        Duration::from_millis(duration.as_millis() as u64)
    };
    humantime::format_duration(rounded).to_string()
}

/// How long ago `at` was.
pub fn ago(at: OffsetDateTime) -> String {
    let age = OffsetDateTime::now_utc() - at;
    format!("{} ago", human(Duration::try_from(age).unwrap_or_default()))
}

/// `text` cut to `max` characters, with an ellipsis if cut.
pub fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// An optional value for a table cell.
pub fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| value.to_string())
}

/// A retention for people: `forever`, or a duration.
pub fn retention(retention: Option<Duration>) -> String {
    retention.map_or_else(|| "forever".to_owned(), human)
}
