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

/// Query parameters whose value is a secret, compared without letter case: every
/// connection keyword libpq documents as one to hide (its `dispchar` `*`: `password`,
/// `sslpassword`, the passphrase of the `sslkey` file, and `oauth_client_secret`), which
/// are also the only ones an `amqp://` URL could carry. File paths (`sslkey`,
/// `passfile`, `sslcert`) name where a secret lies, not the secret: they are shown.
pub const SECRET_QUERY_KEYS: [&str; 3] = ["password", "sslpassword", "oauth_client_secret"];

fn is_secret_key(key: &str) -> bool {
    SECRET_QUERY_KEYS
        .iter()
        .any(|secret| key.trim().eq_ignore_ascii_case(secret))
}

/// Replace the password of a URL (its userinfo's, and every [`SECRET_QUERY_KEYS`] query
/// parameter's) with `***`; a libpq multi-host URL (`h1:5432,h2:5433`) keeps its host
/// list.
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
    // Each parameter as it was written, but a secret one's value: nothing else is
    // re-encoded.
    if let Some(query) = url.query() {
        let shown: Vec<String> = query
            .split('&')
            .map(|pair| {
                let name = pair.split_once('=').map_or(pair, |(k, _)| k);
                let decoded = url::form_urlencoded::parse(name.as_bytes())
                    .next()
                    .map(|(k, _)| k.into_owned())
                    .unwrap_or_default();
                if is_secret_key(&decoded) {
                    format!("{name}=***")
                } else {
                    pair.to_owned()
                }
            })
            .collect();
        url.set_query(Some(&shown.join("&")));
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
    use super::{SECRET_QUERY_KEYS, redact_url};

    /// Every keyword libpq's `PQconndefaults()` marks as secret (`dispchar` `*`, in
    /// `fe-connect.c` of PostgreSQL 18: `password`, `sslpassword`,
    /// `oauth_client_secret`), in any letter case, percent-encoded or not, in postgres
    /// and amqp URLs, single- and multi-host: the value never shows, the rest does.
    #[test]
    fn every_secret_libpq_documents_is_redacted_in_every_url() {
        let libpq_secrets = ["password", "sslpassword", "oauth_client_secret"];
        assert_eq!(SECRET_QUERY_KEYS, libpq_secrets);
        let secret = "s3cr3t-V4lue";
        for key in libpq_secrets {
            for spelled in [
                key.to_owned(),
                key.to_uppercase(),
                // `p` percent-encoded: the parser decodes names before comparing.
                format!("%{:02X}{}", key.as_bytes()[0], &key[1..]),
            ] {
                for base in [
                    "postgres://u@db:5432/app?sslmode=verify-full&sslkey=/k/client.key",
                    "postgres://u@h1:5432,h2:5433/app?sslkey=/k/client.key",
                    "amqps://u@broker:5671/%2f?heartbeat=30",
                ] {
                    let url = format!("{base}&{spelled}={secret}");
                    let shown = redact_url(&url);
                    assert!(!shown.contains(secret), "{url} -> {shown}");
                    assert!(shown.contains("=***"), "{url} -> {shown}");
                    assert!(
                        shown.contains("/k/client.key") || base.starts_with("amqp"),
                        "the key file's path is no secret: {shown}"
                    );
                }
            }
        }
        // The userinfo's password too, in both schemes; the user stays.
        for url in [
            format!("postgres://app:{secret}@db/app?sslpassword={secret}"),
            format!("amqp://app:{secret}@broker/%2f?password={secret}"),
        ] {
            let shown = redact_url(&url);
            assert!(
                !shown.contains(secret) && shown.contains("app:***@"),
                "{shown}"
            );
        }
        // Other keys are no secret and are shown as they were.
        assert_eq!(
            redact_url("postgres://u@db/app?sslmode=require&application_name=x&passfile=/p"),
            "postgres://u@db/app?sslmode=require&application_name=x&passfile=/p"
        );
    }

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
