//! Logging: tracing-subscriber in text or JSON, level from RUST_LOG (default info), and a
//! limiter so a flood of bad input costs a few log lines, not a full disk.
//!
//! Two rules hold whatever RUST_LOG says (contract section 8, "Secrets stay secret"):
//! the libraries that can log credentials are capped ([`SECRET_CAPS`]), and every line
//! is written with the characters that could steer a terminal escaped ([`escape`]), so
//! a row's exchange name or a broker's error text cannot forge log lines or colours.
//! The same escaping serves every command's text and JSON output.

use std::borrow::Cow;
use std::io::Write;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// The most these targets (and every target they prefix) may log, whatever RUST_LOG
/// asks: below it they print credentials. lapin's DEBUG/TRACE events print every frame
/// it writes or queues, the login frame (`connection.start-ok`, whose response is the
/// SASL PLAIN `\0user\0password`, as a byte list) among them, and its internal RPC
/// commands; amq-protocol-tcp's TRACE "Connecting." prints the broker URI, password
/// included. sqlx prints no credentials that we know of, but its DEBUG/TRACE events
/// print statements and connection details: capped alike, as defence in depth; its
/// `.pgpass` reader warns with a malformed line of that file whole, password and all.
const SECRET_CAPS: [(&str, LevelFilter); 4] = [
    ("lapin", LevelFilter::INFO),
    ("amq_protocol", LevelFilter::INFO),
    ("sqlx", LevelFilter::INFO),
    ("sqlx_postgres::options::pgpass", LevelFilter::ERROR),
];

/// Libraries that log the failures they also return: a command that is not the daemon
/// prints the error it gets once (`error: …`), so their lines are left out.
const ECHOING: [&str; 2] = ["lapin", "amq_protocol"];

/// Install the global subscriber (once; later calls are ignored, which suits tests).
/// `daemon`: `timeoutd run`, which logs what its libraries say; the other commands
/// leave out [`ECHOING`].
pub fn init(format: LogFormat, daemon: bool) {
    let asked =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    // Both must let an event through: a directive of the user's for a narrower target
    // (`lapin::io_loop=trace`) cannot lift a cap.
    let caps = Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_targets(SECRET_CAPS.map(|(target, cap)| {
            let echoes = !daemon && ECHOING.contains(&target);
            (target, if echoes { LevelFilter::OFF } else { cap })
        }));
    let layer = tracing_subscriber::fmt::layer();
    let layer = match format {
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_writer(Escaping::new(std::io::stderr, Spelling::Unicode))
            .boxed(),
        // No colours: the writer escapes every control character, the formatter's own
        // colour codes alike.
        LogFormat::Text => layer
            .with_ansi(false)
            .with_writer(Escaping::new(std::io::stderr, Spelling::Rust))
            .boxed(),
    };
    // Global filters, each a layer of its own: an event must pass both. (As one per-layer
    // filter, `asked.and(caps)`, events went missing under load: a node's "role changed",
    // a row's "not published".)
    let _ = tracing_subscriber::registry()
        .with(asked)
        .with(caps)
        .with(layer)
        .try_init();
}

/// How [`escape`] spells what it escapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    /// `\x1b`, `\r`, `\u{202e}`: plain text for people.
    Rust,
    /// `\u001b`, `\u202e`, for JSON and TOML text: valid inside their strings, the only
    /// place such characters can be in that text (serde_json and toml escape C0 there
    /// already, but not DEL, C1 or the bidi controls). Line breaks and tabs are left as
    /// they are: outside strings they are the text's own layout.
    Unicode,
}

/// Whether `c` can move a terminal's cursor, change its state, or reorder or break what
/// it shows: C0 and C1 controls and DEL (`Cc`), the Unicode bidi controls (U+202E
/// "right-to-left override" makes `exe.txt` of `txt.exe`) and line separators.
fn steers_terminal(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{2028}'
                | '\u{2029}'
        )
}

/// `text` with every character that could steer a terminal escaped (see
/// [`steers_terminal`]); everything else, other non-ASCII text included, as it is.
pub fn escape(text: &str, spelling: Spelling) -> Cow<'_, str> {
    let escaped = |c: char| {
        steers_terminal(c) && !(spelling == Spelling::Unicode && matches!(c, '\n' | '\t'))
    };
    if !text.chars().any(escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !escaped(c) {
            out.push(c);
            continue;
        }
        let code = u32::from(c);
        let escaped = match (spelling, c) {
            (Spelling::Rust, '\n') => "\\n".to_owned(),
            (Spelling::Rust, '\r') => "\\r".to_owned(),
            (Spelling::Rust, '\t') => "\\t".to_owned(),
            (Spelling::Rust, _) if code < 0x80 => format!("\\x{code:02x}"),
            (Spelling::Rust, _) => format!("\\u{{{code:x}}}"),
            (Spelling::Unicode, _) => format!("\\u{code:04x}"),
        };
        out.push_str(&escaped);
    }
    Cow::Owned(out)
}

/// Text for a terminal: [`escape`]d, for `Display` (`println!("{}", Shown(&row.id))`).
pub struct Shown<'a>(pub &'a str);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&escape(self.0, Spelling::Rust))
    }
}

/// A log writer that escapes each event ([`escape`]) but its final newline: the
/// formatter hands over one whole event per write, so a value holding `\n` or `\r`
/// cannot forge a line. Each event reaches the inner writer in one `write_all`, its
/// newline with it: stderr is locked per call, and an event written in two would let
/// another thread's event in between (two events on one line, then an empty one).
struct Escaping<M> {
    inner: M,
    spelling: Spelling,
}

impl<M> Escaping<M> {
    fn new(inner: M, spelling: Spelling) -> Self {
        Self { inner, spelling }
    }
}

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for Escaping<M> {
    type Writer = EscapingWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        EscapingWriter {
            inner: self.inner.make_writer(),
            spelling: self.spelling,
        }
    }
}

struct EscapingWriter<W> {
    inner: W,
    spelling: Spelling,
}

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let (line, end) = match text.strip_suffix('\n') {
            Some(line) => (line, "\n"),
            None => (&*text, ""),
        };
        match escape(line, self.spelling) {
            // Nothing to escape: the event as it came, newline and all.
            Cow::Borrowed(_) if matches!(text, Cow::Borrowed(_)) => self.inner.write_all(buf)?,
            escaped => {
                let mut event = escaped.into_owned();
                event.push_str(end);
                self.inner.write_all(event.as_bytes())?;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// An error with its causes, each once (`error: cause: cause`), for log lines and the
/// commands' `error:` line. Our own error types keep their cause in `source()`, not in
/// their text; some libraries' do both (sqlx's "error returned from database: {0}",
/// lapin's "IO error: {0}"): a cause whose text the error above it already holds is not
/// printed again. A database error is its message and SQLSTATE, without the line of the
/// Postgres source file that raised it ("at line 1371").
pub(crate) struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut above: Option<String> = None;
        let mut next = Some(self.0);
        let mut first = true;
        while let Some(e) = next {
            let text = e.to_string();
            let (shown, last) = match e.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::Database(db)) => (database_error(db.as_ref()), true),
                _ => (text.clone(), false),
            };
            if !above.as_deref().is_some_and(|a| a.contains(&text)) {
                if !first {
                    f.write_str(": ")?;
                }
                f.write_str(&shown)?;
                first = false;
            }
            above = Some(text);
            next = if last { None } else { e.source() };
        }
        Ok(())
    }
}

/// What the database said, and its SQLSTATE for looking it up.
fn database_error(db: &dyn sqlx::error::DatabaseError) -> String {
    match db.code() {
        Some(code) => format!("{} (SQLSTATE {code})", db.message()),
        None => db.message().to_owned(),
    }
}

/// Lets one event through per `every`; counts the ones it held back.
#[derive(Debug)]
pub struct LogLimiter {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(n)` when this event should be logged, `n` being how many were held back
    /// since the last one logged; `None` to stay quiet.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.every)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause printed once, by the log helper and by anyhow's `{:#}` at the edges.
    #[test]
    fn an_error_chain_names_each_cause_once() {
        let e = crate::store::StoreError::Db(sqlx::Error::PoolTimedOut);
        let cause = sqlx::Error::PoolTimedOut.to_string();
        let expected = format!("database: {cause}");
        assert_eq!(Chain(&e).to_string(), expected);
        assert_eq!(format!("{:#}", anyhow::Error::new(e)), expected);
        let scan = crate::firing::BatchError::Commit {
            fired: 3,
            source: crate::store::StoreError::NoAnswer(std::time::Duration::from_secs(1)),
        };
        let text = Chain(&scan).to_string();
        assert_eq!(text.matches("no answer").count(), 1, "{text}");
    }

    /// A library error whose text already holds its source's (as sqlx's and lapin's do).
    #[derive(Debug, thiserror::Error)]
    #[error("IO error: {0}")]
    struct Echoing(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("connecting to RabbitMQ")]
    struct Outer(#[source] Echoing);

    #[test]
    fn a_cause_already_in_the_text_above_is_not_repeated() {
        let io = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Outer(Echoing(io()));
        assert_eq!(
            Chain(&e).to_string(),
            "connecting to RabbitMQ: IO error: refused"
        );
        let e = anyhow::Error::new(Echoing(io())).context("members");
        assert_eq!(Chain(&*e).to_string(), "members: IO error: refused");
        let e = anyhow::Error::new(sqlx::Error::Io(io())).context("counting");
        let text = Chain(&*e).to_string();
        assert_eq!(text.matches("refused").count(), 1, "{text}");
    }

    #[test]
    fn escape_spells_every_terminal_control_and_leaves_the_rest() {
        let nasty = "a\u{1b}[31m\r\u{7}\u{7f}\u{9b}\u{202e}\u{2028}\tb é 日本\n";
        assert_eq!(
            escape(nasty, Spelling::Rust),
            "a\\x1b[31m\\r\\x07\\x7f\\u{9b}\\u{202e}\\u{2028}\\tb é 日本\\n"
        );
        assert_eq!(
            escape(nasty, Spelling::Unicode),
            "a\\u001b[31m\\u000d\\u0007\\u007f\\u009b\\u202e\\u2028\tb é 日本\n",
            "line breaks and tabs are JSON's and TOML's layout"
        );
        assert!(matches!(
            escape("plain é", Spelling::Rust),
            Cow::Borrowed(_)
        ));
        let json =
            serde_json::to_string_pretty(&serde_json::json!({ "k": nasty })).expect("serializes");
        let back: serde_json::Value =
            serde_json::from_str(&escape(&json, Spelling::Unicode)).expect("still JSON");
        assert_eq!(back["k"], nasty, "the same value, only spelled safely");
    }

    #[test]
    fn the_log_writer_keeps_one_line_per_event() {
        let mut out = Vec::new();
        let mut w = EscapingWriter {
            inner: &mut out,
            spelling: Spelling::Rust,
        };
        w.write_all(b"WARN exchange=x\nINFO forged\r\n")
            .expect("write");
        assert_eq!(out, b"WARN exchange=x\\nINFO forged\\r\n");
    }

    /// What the inner writer was handed, call by call.
    #[derive(Default)]
    struct Calls(Vec<Vec<u8>>);

    impl Write for Calls {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn each_event_reaches_the_inner_writer_in_one_write_newline_included() {
        for (event, written) in [
            (&b"INFO plain\n"[..], &b"INFO plain\n"[..]),
            (b"WARN exchange=x\ny\n", b"WARN exchange=x\\ny\n"),
            (b"INFO \xff\n", "INFO \u{fffd}\n".as_bytes()),
        ] {
            let mut w = EscapingWriter {
                inner: Calls::default(),
                spelling: Spelling::Rust,
            };
            w.write_all(event).expect("write");
            assert_eq!(w.inner.0, vec![written.to_vec()], "{event:?}");
        }
    }

    #[test]
    fn limiter_lets_one_through_per_period_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut l = LogLimiter::new(Duration::from_secs(1));
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..=5 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i * 100)), None);
        }
        assert_eq!(l.allow(t0 + Duration::from_secs(1)), Some(5));
    }
}
