//! The kinds of due rows timeoutd fires: the one name for "which table, which message"
//! that the scan, the store, the metrics, the CLI and the console share.

use serde::Deserialize;

/// A kind of due row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The process manager's expectations (contract section 2), fired as TimeOuts.
    Expectation,
    /// Messages published with a delay (contract section 7), delivered as they were.
    Delayed,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Expectation, Kind::Delayed];

    /// What logs, metrics (`kind` label), `pending` and the console call it.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Expectation => "expectation",
            Kind::Delayed => "delayed",
        }
    }

    /// What its message is called in logs.
    pub const fn message(self) -> &'static str {
        match self {
            Kind::Expectation => "TimeOut",
            Kind::Delayed => "delayed message",
        }
    }

    /// The notification that makes the active node look at this kind's rows from the
    /// start: the trigger's payload for a row due at `'-infinity'` (migration 0010), the
    /// only form the listener takes without a due time.
    pub fn look_from_start(self) -> String {
        format!("{}:-", self.name())
    }

    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Its position in [`Kind::ALL`], for per-kind arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_index_all() {
        for (i, k) in Kind::ALL.into_iter().enumerate() {
            assert_eq!(Kind::parse(k.name()), Some(k));
            assert_eq!(k.index(), i);
        }
        assert_eq!(Kind::parse("expectations"), None);
    }
}
