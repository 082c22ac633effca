//! Not in lapin as published (carried by timeoutd): a guard on received content-header
//! frames.
//!
//! - RabbitMQ sends a content-header frame whole, whatever `frame_max` says, with its own
//!   headers (`x-delivery-count`, `x-death`) added to what the publisher sent within
//!   `frame_max`. The I/O loop takes such a frame instead of closing the connection (a
//!   frame that fits its receive buffer, 32 frames, can be read; the connection does not
//!   depend on it being small).
//! - Field tables are parsed (and dropped) recursively: headers nested a few thousand
//!   deep overflow the stack of the I/O thread. A header frame whose tables and arrays
//!   nest deeper than [`MAX_DEPTH`] is not parsed as it is: it is delivered with its
//!   headers replaced by one, [`REFUSED_HEADER`], saying why, so that the application
//!   can refuse the message (its body and other properties are kept).

use crate::parsing::ParsingContext;
use amq_protocol::frame::{
    AMQPFrame,
    parsing::{parse_content_header, traits::Input},
};

/// Deepest nesting of tables and arrays parsed in a content header's `headers` (the
/// headers table itself is level 1).
pub const MAX_DEPTH: usize = 64;

/// The header that replaces the headers of a content header nested deeper than
/// [`MAX_DEPTH`]; its value (a long string) says why.
pub const REFUSED_HEADER: &str = "x-lapin-refused";

const FRAME_HEADER: u8 = 2;
const FRAME_END: u8 = 0xCE;
/// Flags of `content_type`, `content_encoding` and `headers` in the basic class.
const CONTENT_TYPE: u16 = 1 << 15;
const CONTENT_ENCODING: u16 = 1 << 14;
const HEADERS: u16 = 1 << 13;

/// The frame at the start of `input` if it is a complete content-header frame whose
/// headers nest deeper than [`MAX_DEPTH`]: how many bytes it takes, and the frame to
/// deliver in its place. `None` for any other frame (parsed as lapin always did).
pub(crate) fn too_deep(input: &ParsingContext<'_>) -> Option<(usize, AMQPFrame)> {
    let mut head = input.iter_elements();
    if head.next()? != FRAME_HEADER {
        return None;
    }
    let channel = u16::from_be_bytes([head.next()?, head.next()?]);
    let size = u32::from_be_bytes([head.next()?, head.next()?, head.next()?, head.next()?]);
    let size = usize::try_from(size).ok()?;
    let total = 7usize.checked_add(size)?.checked_add(1)?;
    if input.input_len() < total {
        return None;
    }
    let payload: Vec<u8> = input.take_from(7).take(size).iter_elements().collect();
    if input.take_from(7 + size).iter_elements().next()? != FRAME_END {
        return None;
    }
    let (start, end) = headers_span(&payload)?;
    if depth(&payload[start..end])? <= MAX_DEPTH {
        return None;
    }
    let mut replaced = payload[..start].to_vec();
    replaced.extend_from_slice(&refused_table(&format!(
        "header tables or arrays nested deeper than {MAX_DEPTH} levels"
    )));
    replaced.extend_from_slice(&payload[end..]);
    let (_, header) = parse_content_header(replaced.as_slice()).ok()?;
    Some((total, AMQPFrame::Header(channel, header)))
}

/// Where the headers table (its length included) lies in a content header's payload.
fn headers_span(payload: &[u8]) -> Option<(usize, usize)> {
    // class id, weight, body size, then the property flags.
    let flags = u16::from_be_bytes([*payload.get(12)?, *payload.get(13)?]);
    if flags & HEADERS == 0 || flags & 1 != 0 {
        return None;
    }
    let mut at = 14;
    for flag in [CONTENT_TYPE, CONTENT_ENCODING] {
        if flags & flag != 0 {
            at += 1 + usize::from(*payload.get(at)?);
        }
    }
    let len = long(payload, at)?;
    let end = at.checked_add(4)?.checked_add(len)?;
    (end <= payload.len()).then_some((at, end))
}

/// How deep the tables and arrays of a field table (its length included) nest, without
/// recursion; `None` when it is malformed (the parser then says so).
fn depth(table: &[u8]) -> Option<usize> {
    // The end of every open table or array, and whether it is a table.
    let mut open: Vec<(usize, bool)> = vec![(4usize.checked_add(long(table, 0)?)?, true)];
    let mut at = 4;
    let mut deepest = 1;
    while let Some(&(end, is_table)) = open.last() {
        if at == end {
            open.pop();
            continue;
        }
        if at > end {
            return None;
        }
        if is_table {
            at += 1 + usize::from(*table.get(at)?);
        }
        let kind = *table.get(at)?;
        at += 1;
        at += match kind {
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'V' => 0,
            b'S' | b'x' => 4usize.checked_add(long(table, at)?)?,
            b'A' | b'F' => {
                let inner_end = (at + 4).checked_add(long(table, at)?)?;
                open.push((inner_end, kind == b'F'));
                deepest = deepest.max(open.len());
                if deepest > MAX_DEPTH {
                    return Some(deepest);
                }
                4
            }
            _ => return None,
        };
    }
    (at == table.len()).then_some(deepest)
}

fn long(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    usize::try_from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])).ok()
}

/// A field table of one long string, `REFUSED_HEADER` = `why`.
fn refused_table(why: &str) -> Vec<u8> {
    let mut entries = vec![u8::try_from(REFUSED_HEADER.len()).unwrap_or(0)];
    entries.extend_from_slice(REFUSED_HEADER.as_bytes());
    entries.push(b'S');
    entries.extend_from_slice(&u32::try_from(why.len()).unwrap_or(0).to_be_bytes());
    entries.extend_from_slice(why.as_bytes());
    let mut table = u32::try_from(entries.len())
        .unwrap_or(0)
        .to_be_bytes()
        .to_vec();
    table.extend_from_slice(&entries);
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::AMQPValue;

    fn nested(levels: usize) -> Vec<u8> {
        let mut inner = 0u32.to_be_bytes().to_vec();
        for _ in 1..levels {
            let mut entry = vec![1, b'a', b'F'];
            entry.extend_from_slice(&inner);
            inner = (entry.len() as u32).to_be_bytes().to_vec();
            inner.extend_from_slice(&entry);
        }
        inner
    }

    fn frame(headers: &[u8]) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        payload.extend_from_slice(&(CONTENT_TYPE | HEADERS | (1 << 12)).to_be_bytes());
        payload.extend_from_slice(&[4, b't', b'e', b'x', b't']);
        payload.extend_from_slice(headers);
        payload.push(2); // delivery mode
        let mut f = vec![FRAME_HEADER, 0, 1];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(&payload);
        f.push(FRAME_END);
        f
    }

    #[test]
    fn depth_counts_levels_without_recursion() {
        assert_eq!(depth(&nested(1)), Some(1));
        assert_eq!(depth(&nested(5)), Some(5));
        assert_eq!(depth(&nested(100_000)), Some(MAX_DEPTH + 1));
    }

    #[test]
    fn a_frame_nested_too_deep_is_delivered_with_its_headers_replaced() {
        let f = frame(&nested(50_000));
        let (len, frame) = too_deep(&ParsingContext::from(f.as_slice())).expect("too deep");
        assert_eq!(len, f.len());
        let AMQPFrame::Header(1, header) = frame else {
            panic!("not a header frame")
        };
        assert_eq!(header.body_size, 5);
        assert_eq!(
            header
                .properties
                .content_type()
                .as_ref()
                .map(|s| s.as_str()),
            Some("text")
        );
        assert_eq!(*header.properties.delivery_mode(), Some(2));
        let headers = header.properties.headers().clone().expect("headers");
        assert!(matches!(
            headers.inner().get(REFUSED_HEADER),
            Some(AMQPValue::LongString(_))
        ));
    }

    #[test]
    fn other_frames_are_left_to_the_parser() {
        let f = frame(&nested(MAX_DEPTH));
        assert!(too_deep(&ParsingContext::from(f.as_slice())).is_none());
        let incomplete = frame(&nested(1000));
        let cut = &incomplete[..incomplete.len() - 1];
        assert!(too_deep(&ParsingContext::from(cut)).is_none());
    }
}
