//! Where a delayed message may go (contract section 8). The daemon publishes with its own
//! broker rights on behalf of publishers who may hold far fewer: the exchange a message
//! names is judged here, once at ingest and again at delivery (rows stored by an earlier
//! version, or under an earlier configuration), by the one rule below.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// The exchanges delayed messages may be delivered to.
#[derive(Debug, Clone)]
pub struct Destinations {
    target: String,
    allowed: GlobSet,
    announce: String,
    ingress: String,
    /// Every group's ingress: `delay.exchange` with `{group}` as a wildcard.
    any_ingress: GlobSet,
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
        let destinations = Self {
            target: n.target.to_owned(),
            allowed: build(allowed)?,
            announce: n.announce.to_owned(),
            ingress: n.ingress.to_owned(),
            any_ingress: build({
                let mut b = GlobSetBuilder::new();
                b.add(glob(&any_ingress)?);
                b
            })?,
        };
        if let Some(why) = destinations.never(n.target) {
            return Err(DestinationError::Target(format!(
                "{:?} can never receive delayed messages: {why}",
                n.target
            )));
        }
        Ok(destinations)
    }

    /// Allows nothing: what a node falls back to if its settings were never validated.
    pub fn nowhere() -> Self {
        Self {
            target: String::new(),
            allowed: GlobSet::empty(),
            announce: String::new(),
            ingress: String::new(),
            any_ingress: GlobSet::empty(),
        }
    }

    /// Where a message goes that names no exchange.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The rule: `Err` says why `exchange` may not receive a delayed message.
    pub fn check(&self, exchange: &str) -> Result<(), String> {
        if let Some(why) = self.never(exchange) {
            return Err(format!(
                "exchange {exchange:?} never receives delayed messages ({why})"
            ));
        }
        if (!self.target.is_empty() && exchange == self.target) || self.allowed.is_match(exchange) {
            return Ok(());
        }
        Err(format!(
            "exchange {exchange:?} is not delay.target_exchange and matches no \
             delay.allowed_exchanges"
        ))
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

    #[test]
    fn nowhere_allows_nothing() {
        let r = Destinations::nowhere();
        for x in ["timeoutd.delayed", "orders", ""] {
            assert!(r.check(x).is_err());
        }
    }
}
