//! Logging: tracing-subscriber in text or JSON, level from RUST_LOG (default info), and a
//! limiter so a flood of bad input costs a few log lines, not a full disk.

use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Install the global subscriber (once; later calls are ignored, which suits tests).
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// An error with its causes, each once (`error: cause: cause`), for log fields: the
/// error types here keep their cause in `source()`, not in their own text.
pub(crate) struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
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
        let scan = crate::fire::ScanError::Commit {
            fired: 3,
            source: crate::store::StoreError::NoAnswer(std::time::Duration::from_secs(1)),
        };
        let text = Chain(&scan).to_string();
        assert_eq!(text.matches("no answer").count(), 1, "{text}");
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
