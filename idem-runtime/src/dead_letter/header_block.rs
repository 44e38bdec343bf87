//! The NATS header block (`NATS/1.0\r\nName: value\r\n...\r\n`), read from
//! bytes exactly as async-nats reads the headers of a delivered message.
//!
//! The runtime reads some messages from their stream rather than through a
//! consumer: a message JetStream gave up on (`consume/undeliverable.rs`), a dead
//! letter (`dead_letter/browse.rs`), a header block moved out of a dead
//! letter (`dead_letter/moved.rs`). The id such a message is recorded under
//! must be the one the pipeline claimed it by, byte for byte, or its replay
//! is claimed under another id: applied a second time, or taken for an
//! unrelated message and lost. So [`read`] reads as async-nats 0.51 does
//! (its `connection.rs`):
//!
//! 1. the block must be UTF-8, and is split into lines at each LF, a CR
//!    right before it dropped (`str::lines`): a bare LF ends a line too;
//! 2. the first line must start with `NATS/1.0` (a status after it must be
//!    a number from 100 to 999);
//! 3. empty lines are skipped; any other line must hold a `:`, and the name
//!    before the first one must be visible ASCII;
//! 4. the value is the rest of the line with its start trimmed, then each
//!    following line that starts with whitespace appended as it is (a
//!    folded header: `A: x<CRLF> y` reads `x y`), then its end trimmed
//!    (Unicode whitespace, both ends);
//! 5. a value that still holds a CR (a bare CR inside a line) panics
//!    async-nats' connection task.
//!
//! A block async-nats cannot read makes it drop its connection (or, for 5,
//! lose it for good), on every delivery: such a message never reaches a
//! handler, and [`read`] says why. JetStream reads the same bytes its own
//! way (its publish dedup takes a `Nats-Msg-Id` up to the CRLF, bare LF
//! and all, and knows no folding), which is why an id read from a block the
//! client cannot read is taken only when both readings agree
//! ([`unambiguous`]).

use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};

/// Why async-nats cannot read a header block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unreadable(pub(crate) &'static str);

/// The headers of `block`, in order, as async-nats reads them; `Err` when
/// it cannot read them (see the module docs).
pub(crate) fn read(block: &[u8]) -> Result<Vec<(String, String)>, Unreadable> {
    let text = std::str::from_utf8(block).map_err(|_| Unreadable("it is not UTF-8"))?;
    let mut lines = text.lines().peekable();
    let version = lines.next().ok_or(Unreadable("it has no version line"))?;
    let status = version
        .strip_prefix("NATS/1.0")
        .ok_or(Unreadable("its first line does not start with NATS/1.0"))?
        .trim();
    let status = status
        .split_once(' ')
        .map_or(status, |(code, _)| code.trim());
    if !status.is_empty() && status.parse::<async_nats::StatusCode>().is_err() {
        return Err(Unreadable("its status is not a number from 100 to 999"));
    }
    let mut headers = Vec::new();
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line
            .split_once(':')
            .ok_or(Unreadable("a line holds no `:`"))?;
        HeaderName::from_str(name).map_err(|_| Unreadable("a header name is not visible ASCII"))?;
        let mut value = value.trim_start().to_owned();
        while let Some(folded) = lines.next_if(|line| line.starts_with(char::is_whitespace)) {
            value.push_str(folded);
        }
        value.truncate(value.trim_end().len());
        if value.contains(['\r', '\n']) {
            return Err(Unreadable("a value holds a bare CR"));
        }
        headers.push((name.to_owned(), value));
    }
    Ok(headers)
}

/// The headers [`read`] found, as a [`HeaderMap`] (every value of a name
/// kept, in order).
pub(crate) fn to_map(headers: &[(String, String)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        // `read` checked both; a failed parse cannot happen, and skipping
        // is safer than a panic.
        if let (Ok(name), Ok(value)) = (HeaderName::from_str(name), HeaderValue::from_str(value)) {
            map.append(name, value);
        }
    }
    map
}

/// The headers of `block` that can be kept from a block async-nats cannot
/// read: each line on its own, those whose name and value parse (a value
/// with a bare CR, or a name that is not visible ASCII, is left out).
pub(crate) fn lenient(block: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in block
        .split(|&byte| byte == b'\n')
        .skip(1)
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|&byte| byte == b':')?;
            Some((line[..colon].trim_ascii(), line[colon + 1..].trim_ascii()))
        })
    {
        let (Ok(name), Ok(value)) = (std::str::from_utf8(name), std::str::from_utf8(value)) else {
            continue;
        };
        // Fallible parses: async-nats panics on a value with a bare CR.
        if let (Ok(name), Ok(value)) = (HeaderName::from_str(name), HeaderValue::from_str(value)) {
            headers.append(name, value);
        }
    }
    headers
}

/// The value of header `name` in a block async-nats cannot read, when it
/// is unambiguous: `None` if no line names it, `Err` if its value is not
/// UTF-8, holds a bare CR or LF (so that JetStream and a client read it
/// differently), is folded onto the next line, or differs between two
/// lines of that name. Names match exactly, as async-nats and JetStream
/// match them.
pub(crate) fn unambiguous(block: &[u8], name: &str) -> Option<Result<String, ()>> {
    let mut found: Option<String> = None;
    let lines: Vec<&[u8]> = split_crlf(block).collect();
    for (i, line) in lines.iter().enumerate().skip(1) {
        let Some(colon) = line.iter().position(|&byte| byte == b':') else {
            continue;
        };
        if &line[..colon] != name.as_bytes() {
            continue;
        }
        let raw = &line[colon + 1..];
        let folded = lines.get(i + 1).is_some_and(|next| {
            next.first()
                .is_some_and(|&byte| byte == b' ' || byte == b'\t')
        });
        if folded || raw.contains(&b'\r') || raw.contains(&b'\n') {
            return Some(Err(()));
        }
        let Ok(text) = std::str::from_utf8(raw) else {
            return Some(Err(()));
        };
        let value = text.trim().to_owned();
        match &found {
            Some(earlier) if *earlier != value => return Some(Err(())),
            _ => found = Some(value),
        }
    }
    found.map(Ok)
}

/// `block`'s lines as JetStream splits them: at each CRLF.
fn split_crlf(block: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(block);
    std::iter::from_fn(move || {
        let text = rest?;
        match text.windows(2).position(|pair| pair == b"\r\n") {
            Some(end) => {
                rest = Some(&text[end + 2..]);
                Some(&text[..end])
            }
            None => {
                rest = None;
                Some(text)
            }
        }
    })
}

/// `headers` as a header block, as async-nats writes one.
pub(crate) fn write(headers: &HeaderMap) -> Vec<u8> {
    let mut block = Vec::with_capacity(wire_len(headers));
    block.extend_from_slice(b"NATS/1.0\r\n");
    for (name, values) in headers.iter() {
        for value in values {
            block.extend_from_slice(AsRef::<str>::as_ref(name).as_bytes());
            block.extend_from_slice(b": ");
            block.extend_from_slice(value.as_str().as_bytes());
            block.extend_from_slice(b"\r\n");
        }
    }
    block.extend_from_slice(b"\r\n");
    block
}

/// How many bytes `headers` take on the wire, which counts against the
/// server's `max_payload` with the payload (as async-nats counts them).
pub(crate) fn wire_len(headers: &HeaderMap) -> usize {
    if headers.is_empty() {
        return 0;
    }
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|value| AsRef::<str>::as_ref(name).len() + 2 + value.as_str().len() + 2)
                .sum::<usize>()
        })
        .sum();
    b"NATS/1.0\r\n".len() + lines + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn a_block_is_read_as_async_nats_reads_it() {
        let headers =
            read(b"NATS/1.0\r\nTrace: t-1\r\nNats-Msg-Id:  order-7 \t\r\nA: 1\r\nA: 2\r\n\r\n")
                .unwrap();
        assert_eq!(value(&headers, "Nats-Msg-Id"), ["order-7"]);
        assert_eq!(value(&headers, "A"), ["1", "2"], "every value kept");
        // Folded: the next line, as it is, joined on.
        let folded = read(b"NATS/1.0\r\nNats-Msg-Id: fold-x\r\n y\r\n\r\n").unwrap();
        assert_eq!(value(&folded, "Nats-Msg-Id"), ["fold-x y"]);
        let tabbed = read(b"NATS/1.0\r\nNats-Msg-Id: a\r\n\tb\r\n\r\n").unwrap();
        assert_eq!(value(&tabbed, "Nats-Msg-Id"), ["a\tb"]);
        // Unicode whitespace at either end is trimmed, inside it is kept.
        let nbsp =
            read("NATS/1.0\r\nNats-Msg-Id: \u{a0}x\u{a0}y\u{a0}\r\n\r\n".as_bytes()).unwrap();
        assert_eq!(value(&nbsp, "Nats-Msg-Id"), ["x\u{a0}y"]);
        // Names are case-sensitive.
        let lower = read(b"NATS/1.0\r\nnats-msg-id: x\r\n\r\n").unwrap();
        assert!(value(&lower, "Nats-Msg-Id").is_empty());
        assert!(read(b"NATS/1.0 503\r\n\r\n").is_ok());
    }

    #[test]
    fn blocks_async_nats_cannot_read_are_refused() {
        for (block, why) in [
            (
                &b"NATS/1.0\r\nNats-Msg-Id: lf-x\ny\r\n\r\n"[..],
                "a line holds no `:`",
            ),
            (
                b"NATS/1.0\r\nNats-Msg-Id: \xff\xfe\r\n\r\n",
                "it is not UTF-8",
            ),
            (
                b"NATS/1.0\r\nX-Note: a\rb\r\n\r\n",
                "a value holds a bare CR",
            ),
            (
                b"NATS/1.0\r\nBad Name: x\r\n\r\n",
                "a header name is not visible ASCII",
            ),
            (
                b"HTTP/1.1\r\n\r\n",
                "its first line does not start with NATS/1.0",
            ),
            (
                b"NATS/1.0 xyz\r\n\r\n",
                "its status is not a number from 100 to 999",
            ),
        ] {
            assert_eq!(
                read(block),
                Err(Unreadable(why)),
                "{}",
                String::from_utf8_lossy(block)
            );
        }
    }

    #[test]
    fn an_id_from_an_unreadable_block_is_taken_only_when_unambiguous() {
        let id = |block: &[u8]| unambiguous(block, "Nats-Msg-Id");
        // Another header makes the block unreadable; the id itself is clean.
        assert_eq!(
            id(b"NATS/1.0\r\nNats-Msg-Id: a-1 \r\nX: \xff\r\n\r\n"),
            Some(Ok("a-1".into()))
        );
        assert_eq!(id(b"NATS/1.0\r\nX: \xff\r\n\r\n"), None);
        // A bare LF: JetStream reads `lf-x\ny`, a client `lf-x`.
        assert_eq!(
            id(b"NATS/1.0\r\nNats-Msg-Id: lf-x\ny\r\n\r\n"),
            Some(Err(()))
        );
        assert_eq!(id(b"NATS/1.0\r\nNats-Msg-Id: cr\rx\r\n\r\n"), Some(Err(())));
        assert_eq!(
            id(b"NATS/1.0\r\nNats-Msg-Id: f\r\n y\r\nX: \xff\r\n\r\n"),
            Some(Err(()))
        );
        assert_eq!(
            id(b"NATS/1.0\r\nNats-Msg-Id: \xff\xfe\r\n\r\n"),
            Some(Err(()))
        );
        assert_eq!(
            id(b"NATS/1.0\r\nNats-Msg-Id: a\r\nNats-Msg-Id: b\r\nX: \xff\r\n\r\n"),
            Some(Err(()))
        );
    }

    #[test]
    fn a_written_block_reads_back_the_same() {
        let mut headers = HeaderMap::new();
        headers.append("A", "1");
        headers.append("A", "2");
        headers.insert("Trace", "t-1");
        let block = write(&headers);
        assert_eq!(block.len(), wire_len(&headers));
        assert_eq!(to_map(&read(&block).unwrap()), headers);
        assert_eq!(wire_len(&HeaderMap::new()), 0);
        let lenient = lenient(b"NATS/1.0\r\nX: a\rb\r\nY: fine\r\nNats-Msg-Id: lf\nz\r\n\r\n");
        assert!(lenient.get("X").is_none());
        assert_eq!(lenient.get("Y").map(|v| v.as_str()), Some("fine"));
    }
}
