//! A connection URL that may carry a password: the password reaches the driver and
//! nothing else. `Debug` and `Serialize` (logs, `check-config`) show it redacted, so a
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

    /// The URL with every password replaced by `***`.
    pub fn redacted(&self) -> String {
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

/// Replace the password of a URL (and a `password=` query parameter) with `***`.
pub fn redact_url(raw: &str) -> String {
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
