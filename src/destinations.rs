//! Where what timeoutd publishes may go (contract section 8): delayed messages and
//! TimeOuts. The daemon publishes with its own broker rights on behalf of publishers who
//! may hold far fewer: the exchange a message or a row names is judged here, at ingest,
//! again at delivery (rows written directly, by an earlier version, or under an earlier
//! configuration), and, in the form [`Destinations::sql`] gives, at the SQL door.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// The exchanges one kind of message may be delivered to.
#[derive(Debug, Clone)]
pub struct Destinations {
    /// What is delivered, for the reasons given.
    what: &'static str,
    /// The setting that allows more, for the reasons given.
    setting: &'static str,
    target: String,
    allowed: GlobSet,
    /// The patterns of `allowed`, for the SQL form.
    patterns: Vec<String>,
    /// Names refused by default that the setting names exactly (TimeOuts only).
    explicit: Vec<String>,
    announce: String,
    ingress: String,
    /// `delay.exchange` as configured.
    ingress_template: String,
    /// Every group's ingress: `delay.exchange` with `{group}` as a wildcard.
    any_ingress: GlobSet,
}

/// A rule in the form the SQL door reads (POSIX regular expressions, as Postgres' `~`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlRule {
    pub allowed: String,
    pub explicit: Vec<String>,
    pub never: String,
}

/// The names a deployment's [`Destinations`] are made of.
#[derive(Debug, Clone, Copy)]
pub struct Names<'a> {
    /// `delay.target_exchange`: allowed unless refused below.
    pub target: &'a str,
    /// `delay.allowed_exchanges`: names or glob patterns.
    pub allowed: &'a [String],
    /// `amqp.announce_exchange`.
    pub announce: &'a str,
    /// `delay.exchange` as configured, `{group}` and all.
    pub ingress_template: &'a str,
    /// This group's ingress exchange.
    pub ingress: &'a str,
}

/// A configuration the rule cannot be built from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    #[error("{pattern:?} is not a valid pattern: {reason}")]
    Pattern { pattern: String, reason: String },
    #[error("{0}")]
    Target(String),
}

/// What `{group}` stands for in `delay.exchange`.
const GROUP: &str = "{group}";

impl Destinations {
    pub fn new(n: Names<'_>) -> Result<Self, DestinationError> {
        let destinations = Self::build(n)?;
        if let Some(why) = destinations.never(n.target) {
            return Err(DestinationError::Target(format!(
                "{:?} can never receive delayed messages: {why}",
                n.target
            )));
        }
        Ok(destinations)
    }

    fn build(n: Names<'_>) -> Result<Self, DestinationError> {
        let mut allowed = GlobSetBuilder::new();
        for pattern in n.allowed {
            allowed.add(glob(pattern)?);
        }
        let any_ingress = n
            .ingress_template
            .split(GROUP)
            .map(globset::escape)
            .collect::<Vec<_>>()
            .join("*");
        Ok(Self {
            what: "delayed messages",
            setting: "is not delay.target_exchange and matches no delay.allowed_exchanges",
            target: n.target.to_owned(),
            allowed: build(allowed)?,
            patterns: n.allowed.to_vec(),
            explicit: Vec::new(),
            announce: n.announce.to_owned(),
            ingress: n.ingress.to_owned(),
            ingress_template: n.ingress_template.to_owned(),
            any_ingress: build({
                let mut b = GlobSetBuilder::new();
                b.add(glob(&any_ingress)?);
                b
            })?,
        })
    }

    /// The rule for TimeOuts: what `allowed` (`timeouts.allowed_exchanges`, names or
    /// patterns) matches, but never the announcement or an ingress exchange, and the
    /// default exchange or an `amq.*` one only as a deployment's conscious choice: when
    /// `default_exchange` (`timeouts.allow_default_exchange`), or named exactly in
    /// `allowed`. `n.target` and `n.allowed` are not read.
    pub fn for_timeouts(
        n: Names<'_>,
        allowed: &[String],
        default_exchange: bool,
    ) -> Result<Self, DestinationError> {
        let mut rule = Self::build(Names {
            target: "",
            allowed,
            ..n
        })?;
        rule.what = "TimeOuts";
        rule.setting = "matches no timeouts.allowed_exchanges";
        rule.explicit = allowed
            .iter()
            .filter(|a| a.starts_with("amq.") && !a.contains(['*', '?', '[', '{', '\\']))
            .cloned()
            .chain(default_exchange.then(String::new))
            .collect();
        Ok(rule)
    }

    /// Allows nothing: what a node falls back to if its settings were never validated.
    pub fn nowhere() -> Self {
        Self {
            what: "messages",
            setting: "is allowed by no valid setting",
            target: String::new(),
            allowed: GlobSet::empty(),
            patterns: Vec::new(),
            explicit: Vec::new(),
            announce: String::new(),
            ingress: String::new(),
            ingress_template: String::new(),
            any_ingress: GlobSet::empty(),
        }
    }

    /// Where a message goes that names no exchange.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The rule: `Err` says why `exchange` may not receive the message.
    pub fn check(&self, exchange: &str) -> Result<(), String> {
        if let Some(why) = self.never(exchange) {
            if self.explicit.iter().any(|e| e == exchange) && !self.steers(exchange) {
                return Ok(());
            }
            return Err(format!(
                "exchange {exchange:?} never receives {} ({why})",
                self.what
            ));
        }
        if (!self.target.is_empty() && exchange == self.target) || self.allowed.is_match(exchange) {
            return Ok(());
        }
        Err(format!("exchange {exchange:?} {}", self.setting))
    }

    /// The rule as the SQL door reads it (migration 0011's `api_rules`): POSIX regular
    /// expressions of what is allowed and of the announcement and ingress exchanges,
    /// and the names allowed despite the default refusal.
    pub fn sql(&self) -> SqlRule {
        let allowed = std::iter::once(&self.target)
            .filter(|t| !t.is_empty())
            .map(|t| format!("^{}$", are_escape(t)))
            .chain(
                self.patterns
                    .iter()
                    .map(|p| format!("^{}$", glob_to_are(p))),
            )
            .collect::<Vec<_>>();
        SqlRule {
            allowed: if allowed.is_empty() {
                "^$".to_owned()
            } else {
                allowed.join("|")
            },
            explicit: self.explicit.clone(),
            never: format!(
                "^{}$|^{}$|^{}$",
                are_escape(&self.announce),
                are_escape(&self.ingress),
                self.any_ingress_pattern()
            ),
        }
    }

    /// The announcement exchange and the ingress exchanges: refused even when named.
    fn steers(&self, exchange: &str) -> bool {
        exchange == self.announce || exchange == self.ingress || self.any_ingress.is_match(exchange)
    }

    fn any_ingress_pattern(&self) -> String {
        self.ingress_template
            .split(GROUP)
            .map(are_escape)
            .collect::<Vec<_>>()
            .join(".*")
    }

    /// Exchanges refused whatever is configured, and why.
    fn never(&self, exchange: &str) -> Option<&'static str> {
        if exchange.is_empty() {
            Some("the default exchange reaches every queue by name")
        } else if exchange.starts_with("amq.") {
            Some("amq.* exchanges are the broker's")
        } else if exchange == self.announce {
            Some("the announcement exchange steers the election")
        } else if exchange == self.ingress || self.any_ingress.is_match(exchange) {
            Some("an ingress exchange would delay it again, or for another group")
        } else {
            None
        }
    }
}

/// A name as a POSIX regular expression matching exactly it.
fn are_escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if "\\^$.|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A glob pattern, as [`glob`] reads it, as a POSIX regular expression (unanchored).
fn glob_to_are(pattern: &str) -> String {
    let mut out = String::new();
    let mut chars = pattern.chars().peekable();
    let mut alternatives = 0usize;
    while let Some(c) = chars.next() {
        match c {
            '*' => out.push_str(".*"),
            '?' => out.push('.'),
            '\\' => {
                if let Some(n) = chars.next() {
                    out.push_str(&are_escape(&n.to_string()));
                }
            }
            '[' => {
                out.push('[');
                if chars.next_if(|&n| n == '!' || n == '^').is_some() {
                    out.push('^');
                }
                // A `]` first is a member, as in globset.
                if chars.next_if_eq(&']').is_some() {
                    out.push_str("\\]");
                }
                for n in chars.by_ref() {
                    if n == ']' {
                        break;
                    }
                    if n == '\\' {
                        out.push_str("\\\\");
                    } else {
                        out.push(n);
                    }
                }
                out.push(']');
            }
            '{' => {
                alternatives += 1;
                out.push_str("(?:");
            }
            ',' if alternatives > 0 => out.push('|'),
            '}' if alternatives > 0 => {
                alternatives -= 1;
                out.push(')');
            }
            c => out.push_str(&are_escape(&c.to_string())),
        }
    }
    out
}

/// Case-sensitive, as exchange names are; `*` also matches dots.
fn glob(pattern: &str) -> Result<globset::Glob, DestinationError> {
    GlobBuilder::new(pattern)
        .literal_separator(false)
        .backslash_escape(true)
        .build()
        .map_err(|e| DestinationError::Pattern {
            pattern: pattern.to_owned(),
            reason: e.kind().to_string(),
        })
}

fn build(b: GlobSetBuilder) -> Result<GlobSet, DestinationError> {
    b.build().map_err(|e| DestinationError::Pattern {
        pattern: e.glob().unwrap_or_default().to_owned(),
        reason: e.kind().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use regex_automata::meta::Regex;

    use super::*;

    fn rule(allowed: &[&str]) -> Destinations {
        let allowed: Vec<String> = allowed.iter().map(|s| (*s).to_owned()).collect();
        Destinations::new(Names {
            target: "timeoutd.delayed",
            allowed: &allowed,
            announce: "timeoutd.announcements",
            ingress_template: "timeoutd.delay.{group}",
            ingress: "timeoutd.delay.g1",
        })
        .expect("valid")
    }

    #[test]
    fn by_default_only_the_target() {
        let r = rule(&[]);
        assert_eq!(r.check("timeoutd.delayed"), Ok(()));
        for other in ["orders", "timeoutd.delayed2", "Timeoutd.delayed"] {
            assert!(r.check(other).is_err(), "{other}");
        }
    }

    #[test]
    fn names_and_patterns_allow_more() {
        let r = rule(&["orders", "billing.*", "team-[ab].out"]);
        for ok in ["orders", "billing.out", "billing.eu.out", "team-a.out"] {
            assert_eq!(r.check(ok), Ok(()), "{ok}");
        }
        for no in ["orders2", "billing", "team-c.out", "Orders"] {
            assert!(r.check(no).is_err(), "{no}");
        }
    }

    #[test]
    fn some_exchanges_are_never_allowed_whatever_is_configured() {
        let r = rule(&["*", "amq.*", ""]);
        assert_eq!(r.check("anything.else"), Ok(()));
        for never in [
            "",
            "amq.topic",
            "amq.direct",
            "amq.rabbitmq.trace",
            "timeoutd.announcements",
            "timeoutd.delay.g1",
            "timeoutd.delay.other-group",
            "timeoutd.delay.",
        ] {
            let why = r.check(never).expect_err(never);
            assert!(why.contains("never"), "{why}");
        }
    }

    #[test]
    fn a_template_without_group_is_one_ingress() {
        let r = Destinations::new(Names {
            target: "out",
            allowed: &["*".to_owned()],
            announce: "a",
            ingress_template: "billing.delayed",
            ingress: "billing.delayed",
        })
        .expect("valid");
        assert!(r.check("billing.delayed").is_err());
        assert_eq!(r.check("billing.delayed.out"), Ok(()));
    }

    #[test]
    fn a_refused_target_or_a_bad_pattern_is_an_error() {
        for target in [
            "",
            "amq.topic",
            "timeoutd.announcements",
            "timeoutd.delay.x",
        ] {
            let e = Destinations::new(Names {
                target,
                allowed: &[],
                announce: "timeoutd.announcements",
                ingress_template: "timeoutd.delay.{group}",
                ingress: "timeoutd.delay.g1",
            });
            assert!(matches!(e, Err(DestinationError::Target(_))), "{target}");
        }
        let e = Destinations::new(Names {
            target: "t",
            allowed: &["a[".to_owned()],
            announce: "x",
            ingress_template: "i",
            ingress: "i",
        });
        assert!(matches!(e, Err(DestinationError::Pattern { .. })), "{e:?}");
    }

    fn timeouts(allowed: &[&str], default_exchange: bool) -> Destinations {
        let allowed: Vec<String> = allowed.iter().map(|s| (*s).to_owned()).collect();
        Destinations::for_timeouts(
            Names {
                target: "",
                allowed: &[],
                announce: "timeoutd.announcements",
                ingress_template: "timeoutd.delay.{group}",
                ingress: "timeoutd.delay.g1",
            },
            &allowed,
            default_exchange,
        )
        .expect("valid")
    }

    #[test]
    fn timeouts_go_anywhere_allowed_but_never_where_they_steer() {
        let r = timeouts(&["*"], false);
        assert_eq!(r.check("orders"), Ok(()));
        for never in [
            "",
            "amq.direct",
            "timeoutd.announcements",
            "timeoutd.delay.x",
        ] {
            let why = r.check(never).expect_err(never);
            assert!(why.contains("never receives TimeOuts"), "{why}");
        }
        let r = timeouts(
            &["orders.*", "amq.direct", "amq.*", "timeoutd.announcements"],
            true,
        );
        for ok in ["", "amq.direct", "orders.eu"] {
            assert_eq!(r.check(ok), Ok(()), "{ok:?}");
        }
        for no in [
            "amq.topic",
            "timeoutd.announcements",
            "timeoutd.delay.g1",
            "billing",
        ] {
            assert!(r.check(no).is_err(), "{no}");
        }
    }

    /// The SQL door's regular expressions say what the rule says, checked with Rust's
    /// regex engine (whose syntax for these constructs is Postgres' too; the SQL tests
    /// run them in Postgres).
    #[test]
    fn the_sql_form_is_the_same_rule() {
        let names = [
            "",
            "orders",
            "orders2",
            "billing.out",
            "billing",
            "team-a.out",
            "team-c.out",
            "a]b.x",
            "amq.direct",
            "amq.topic",
            "timeoutd.delayed",
            "timeoutd.announcements",
            "timeoutd.delay.g1",
            "timeoutd.delay.",
            "timeoutd.delay.x.y",
            "x{y}",
            "q.e.d",
            "a*b",
            "a\\b",
        ];
        let rules = [
            rule(&[]),
            rule(&[
                "orders",
                "billing.*",
                "team-[ab].out",
                "{x,q}.*",
                "a\\*b",
                "[]a]b.?",
            ]),
            timeouts(&["*"], true),
            timeouts(&["orders", "amq.direct"], false),
        ];
        for r in &rules {
            let sql = r.sql();
            let allowed = Regex::new(&sql.allowed).expect("allowed");
            let never = Regex::new(&sql.never).expect("never");
            // As migration 0011's api_destination() reads them.
            for name in names {
                let by_sql = if never.is_match(name) {
                    false
                } else if sql.explicit.iter().any(|e| e == name) {
                    true
                } else if name.is_empty() || name.starts_with("amq.") {
                    false
                } else {
                    allowed.is_match(name)
                };
                assert_eq!(r.check(name).is_ok(), by_sql, "{name:?} by {sql:?}");
            }
        }
    }

    #[test]
    fn nowhere_allows_nothing() {
        let r = Destinations::nowhere();
        for x in ["timeoutd.delayed", "orders", ""] {
            assert!(r.check(x).is_err());
        }
    }
}
