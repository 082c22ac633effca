//! Secrets in the settings: a connection URL that may carry a password, and a plain
//! secret (the election's group secret). The secret reaches the code that uses it and
//! nothing else: `Debug` and `Serialize` (logs, `check-config`) show it redacted, so a
//! settings dump can never leak it by accident.

use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone)]
pub struct SecretUrl(SecretString);

impl SecretUrl {
    pub fn new(raw: impl Into<String>) -> Self {
        Self(SecretString::from(raw.into()))
    }

    /// The URL with its password, for the driver that connects with it.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    /// The URL with every password replaced by `***` ("" stays "": not set).
    pub fn redacted(&self) -> String {
        if self.expose().trim().is_empty() {
            return String::new();
        }
        redact_url(self.expose())
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for SecretUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for SecretUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::new)
    }
}

/// A secret string; empty means "not set".
#[derive(Clone, Default)]
pub struct Secret(SecretString);

impl Secret {
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    pub fn is_set(&self) -> bool {
        !self.expose().is_empty()
    }

    fn shown(&self) -> &'static str {
        if self.is_set() { "***" } else { "" }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.shown())
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.shown())
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|s| Self(SecretString::from(s)))
    }
}

/// Replace the password of a URL (and a `password=` query parameter) with `***`; a
/// libpq multi-host URL (`h1:5432,h2:5433`) keeps its host list.
pub fn redact_url(raw: &str) -> String {
    if let Some((first, hosts)) = one_host(raw) {
        let one = redact_url(&first);
        let Some((_, host)) = authority(&first) else {
            return one;
        };
        return match one.find(host.as_str()) {
            Some(at) => format!("{}{hosts}{}", &one[..at], &one[at + host.len()..]),
            None => "<unparseable url>".to_owned(),
        };
    }
    let Ok(mut url) = url::Url::parse(raw) else {
        return "<unparseable url>".to_owned();
    };
    if url.password().is_some() {
        let _ = url.set_password(Some("***"));
    }
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .map(|(k, v)| {
            let secret = k.eq_ignore_ascii_case("password");
            (
                k.into_owned(),
                if secret { "***".into() } else { v.into_owned() },
            )
        })
        .collect();
    if !pairs.is_empty() {
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.to_string()
}

/// The userinfo (with its `@`, or empty) and host list of a URL.
fn authority(raw: &str) -> Option<(String, String)> {
    let (_, rest) = raw.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    Some(match authority.rfind('@') {
        Some(at) => (authority[..=at].to_owned(), authority[at + 1..].to_owned()),
        None => (String::new(), authority.to_owned()),
    })
}

/// A multi-host URL as the same URL with its first host only, and the host list.
fn one_host(raw: &str) -> Option<(String, String)> {
    let (userinfo, hosts) = authority(raw)?;
    let (first, _) = hosts.split_once(',')?;
    let from = raw.find("://")? + 3 + userinfo.len();
    let single = format!("{}{first}{}", &raw[..from], &raw[from + hosts.len()..]);
    Some((single, hosts))
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn multi_host_urls_are_redacted_and_keep_their_hosts() {
        assert_eq!(
            redact_url("postgres://u:hunter2@h1:5432,h2:5433/db?target_session_attrs=primary"),
            "postgres://u:***@h1:5432,h2:5433/db?target_session_attrs=primary"
        );
        assert_eq!(
            redact_url("postgres://h1,h2/db?password=hunter2"),
            "postgres://h1,h2/db?password=***"
        );
    }
}
