//! Where what timeoutd publishes may go (contract section 8): delayed messages and
//! TimeOuts. The daemon publishes with its own broker rights on behalf of publishers who
//! may hold far fewer: the exchange a message or a row names is judged here, at ingest,
//! again at delivery (rows written directly, by an earlier version, or under an earlier
//! configuration), and at the SQL door.
//!
//! The rule is one ordered list of steps, the first that matches deciding. The daemon
//! walks it here; the SQL door walks the same list, written to `api_rules` in the form
//! [`Destinations::sql`] gives (POSIX regular expressions), so the two cannot differ.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Serialize;

/// The exchanges one kind of message may be delivered to.
#[derive(Debug, Clone)]
pub struct Destinations {
    target: String,
    steps: Vec<Step>,
}

/// One step of the rule: the exchanges it matches, and its verdict on them.
#[derive(Debug, Clone)]
struct Step {
    matches: Matcher,
    /// `None`: allowed; otherwise why not, said after the exchange's name.
    refuse: Option<String>,
}

#[derive(Debug, Clone)]
enum Matcher {
    Name(String),
    /// Names or glob patterns, and the same as one POSIX regular expression.
    Globs(GlobSet, String),
    /// `amq.*`: the broker's own exchanges.
    Broker,
    Any,
}

impl Matcher {
    fn is_match(&self, exchange: &str) -> bool {
        match self {
            Self::Name(n) => n == exchange,
            Self::Globs(g, _) => g.is_match(exchange),
            Self::Broker => exchange.starts_with("amq."),
            Self::Any => true,
        }
    }

    /// The same as a POSIX regular expression (Postgres' `~`).
    fn are(&self) -> String {
        match self {
            Self::Name(n) => format!("^{}$", are_escape(n)),
            Self::Globs(_, are) => are.clone(),
            Self::Broker => "^amq\\.".to_owned(),
            Self::Any => String::new(),
        }
    }
}

/// One step as the SQL door reads it (migration 0012's `api_destination`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SqlStep {
    pub pattern: String,
    pub refuse: Option<String>,
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
    /// The rule for delayed messages: `n.target` and what `n.allowed` matches, never the
    /// default exchange, `amq.*`, the announcement exchange or an ingress exchange.
    pub fn new(n: Names<'_>) -> Result<Self, DestinationError> {
        let what = "delayed messages";
        let mut steps = never(n, what, &[])?;
        let refused = steps.iter().find(|s| s.matches.is_match(n.target));
        if let Some(why) = refused.and_then(|s| s.refuse.as_deref()) {
            return Err(DestinationError::Target(format!(
                "{:?} can never receive delayed messages: {why}",
                n.target
            )));
        }
        steps.push(allow(Matcher::Name(n.target.to_owned())));
        steps.extend(globs(n.allowed)?.map(allow));
        steps.push(refuse(
            Matcher::Any,
            "is not delay.target_exchange and matches no delay.allowed_exchanges".to_owned(),
        ));
        Ok(Self {
            target: n.target.to_owned(),
            steps,
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
        let explicit: Vec<String> = allowed
            .iter()
            .filter(|a| a.starts_with("amq.") && !a.contains(['*', '?', '[', '{', '\\']))
            .cloned()
            .chain(default_exchange.then(String::new))
            .collect();
        let mut steps = never(n, "TimeOuts", &explicit)?;
        steps.extend(globs(allowed)?.map(allow));
        steps.push(refuse(
            Matcher::Any,
            "matches no timeouts.allowed_exchanges".to_owned(),
        ));
        Ok(Self {
            target: String::new(),
            steps,
        })
    }

    /// Allows nothing: what a node falls back to if its settings were never validated.
    pub fn nowhere() -> Self {
        Self {
            target: String::new(),
            steps: vec![refuse(
                Matcher::Any,
                "is allowed by no valid setting".to_owned(),
            )],
        }
    }

    /// Where a message goes that names no exchange.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The rule: `Err` says why `exchange` may not receive the message.
    pub fn check(&self, exchange: &str) -> Result<(), String> {
        match walk(&self.steps, exchange) {
            None => Ok(()),
            Some(why) => Err(format!("exchange {exchange:?} {why}")),
        }
    }

    /// The rule as the SQL door walks it: the same steps in the same order, each a POSIX
    /// regular expression and its verdict.
    pub fn sql(&self) -> Vec<SqlStep> {
        self.steps
            .iter()
            .map(|s| SqlStep {
                pattern: s.matches.are(),
                refuse: s.refuse.clone(),
            })
            .collect()
    }
}

/// The verdict of the first step that matches: `None` allowed, or why not (no step
/// matching refuses too, though every rule ends with one that matches all).
fn walk<'s>(steps: &'s [Step], exchange: &str) -> Option<&'s str> {
    match steps.iter().find(|s| s.matches.is_match(exchange)) {
        Some(s) => s.refuse.as_deref(),
        None => Some("is allowed by no rule"),
    }
}

fn allow(matches: Matcher) -> Step {
    Step {
        matches,
        refuse: None,
    }
}

fn refuse(matches: Matcher, why: String) -> Step {
    Step {
        matches,
        refuse: Some(why),
    }
}

/// The steps that come first whatever is allowed: the announcement and ingress exchanges
/// (they steer the group) always refused; then `explicit` names allowed; then the
/// default exchange and `amq.*` refused.
fn never(n: Names<'_>, what: &str, explicit: &[String]) -> Result<Vec<Step>, DestinationError> {
    let never = |why: &str| format!("never receives {what} ({why})");
    let any_ingress = n
        .ingress_template
        .split(GROUP)
        .map(glob_escape)
        .collect::<Vec<_>>()
        .join("*");
    let ingress_why = never("an ingress exchange would delay it again, or for another group");
    let mut steps = vec![
        refuse(
            Matcher::Name(n.announce.to_owned()),
            never("the announcement exchange steers the election"),
        ),
        refuse(Matcher::Name(n.ingress.to_owned()), ingress_why.clone()),
    ];
    steps.extend(globs(&[any_ingress])?.map(|m| refuse(m, ingress_why.clone())));
    steps.extend(explicit.iter().map(|e| allow(Matcher::Name(e.clone()))));
    steps.push(refuse(
        Matcher::Name(String::new()),
        never("the default exchange reaches every queue by name"),
    ));
    steps.push(refuse(
        Matcher::Broker,
        never("amq.* exchanges are the broker's"),
    ));
    Ok(steps)
}

/// Names or glob patterns as one matcher; none when there are none.
fn globs(patterns: &[String]) -> Result<Option<Matcher>, DestinationError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut set = GlobSetBuilder::new();
    for pattern in patterns {
        set.add(glob(pattern)?);
    }
    let are = patterns
        .iter()
        .map(|p| format!("^{}$", glob_to_are(p)))
        .collect::<Vec<_>>()
        .join("|");
    Ok(Some(Matcher::Globs(build(set)?, are)))
}
/// A name as a glob pattern matching exactly it. (`globset::escape` leaves a backslash
/// as it is, which the patterns here read as an escape.)
fn glob_escape(name: &str) -> String {
    backslash_before(name, "\\?*[]{},")
}

/// A name as a POSIX regular expression matching exactly it.
fn are_escape(name: &str) -> String {
    backslash_before(name, "\\^$.|?*+()[]{}")
}

/// `name` with a backslash before each of the `special` characters.
fn backslash_before(name: &str, special: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if special.contains(c) {
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

    /// Every character of the configured ingress name is itself, the `{group}` part
    /// any: a backslash, a bracket or a star in it neither escapes nor widens anything.
    #[test]
    fn the_ingress_template_is_taken_literally() {
        let r = Destinations::new(Names {
            target: "out",
            allowed: &["*".to_owned()],
            announce: "a",
            ingress_template: "d\\e[l]*{a,y}.{group}",
            ingress: "d\\e[l]*{a,y}.g1",
        })
        .expect("valid");
        for refused in ["d\\e[l]*{a,y}.g1", "d\\e[l]*{a,y}.other"] {
            assert!(r.check(refused).is_err(), "{refused}");
        }
        for allowed in ["de[l]*{a,y}.g1", "d\\el.g1", "d\\e[l]xa.g1", "d\\e[l]*a.g1"] {
            assert_eq!(r.check(allowed), Ok(()), "{allowed}");
        }
        let sql = r.sql();
        for name in ["d\\e[l]*{a,y}.other", "d\\el.g1", "de[l]*{a,y}.g1"] {
            let by_sql = sql
                .iter()
                .find(|s| Regex::new(&s.pattern).expect("pattern").is_match(name))
                .map(|s| s.refuse.is_none());
            assert_eq!(Some(r.check(name).is_ok()), by_sql, "{name:?} by {sql:?}");
        }
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
            let steps: Vec<(Regex, Option<String>)> = sql
                .iter()
                .map(|s| (Regex::new(&s.pattern).expect("pattern"), s.refuse.clone()))
                .collect();
            // As migration 0012's api_destination() walks them: the first match decides.
            for name in names {
                let by_sql = steps
                    .iter()
                    .find(|(p, _)| p.is_match(name))
                    .map(|(_, refuse)| refuse.is_none());
                assert_eq!(Some(r.check(name).is_ok()), by_sql, "{name:?} by {sql:?}");
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
