//! Several addresses for one service: `amqp.url` as a list of broker URLs, and
//! `postgres.url` in libpq's multi-host form with `target_session_attrs`.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::SecretUrl;

/// `amqp.url`: one or more complete broker URLs (a TOML list, or one string whose
/// comma-separated parts are the URLs, as in the environment). Never empty once
/// validated.
#[derive(Clone)]
pub struct SecretUrls(Vec<SecretUrl>);

impl SecretUrls {
    pub fn new(urls: Vec<SecretUrl>) -> Self {
        Self(urls)
    }

    /// The first URL: whose broker user signs our announcements.
    pub fn first(&self) -> Option<&SecretUrl> {
        self.0.first()
    }

    pub fn iter(&self) -> impl Iterator<Item = &SecretUrl> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for SecretUrls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.0).finish()
    }
}

/// One URL prints as a string (as before lists existed), several as a list; redacted.
impl Serialize for SecretUrls {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(s),
            all => all.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for SecretUrls {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            List(Vec<String>),
            Joined(String),
        }
        let parts: Vec<String> = match Form::deserialize(d)? {
            Form::List(l) => l,
            Form::Joined(s) => s.split(',').map(str::to_owned).collect(),
        };
        Ok(Self(
            parts
                .iter()
                .map(|p| p.trim())
                .filter(|p| !p.is_empty())
                .map(SecretUrl::new)
                .collect(),
        ))
    }
}

/// Which server of a multi-host `postgres.url` is acceptable (libpq's
/// `target_session_attrs`, the values that make sense for a daemon that writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetSession {
    /// The first server that accepts the connection.
    #[default]
    Any,
    /// A server whose sessions are read-write by default (`SHOW transaction_read_only`
    /// is `off`).
    ReadWrite,
    /// A server not in recovery (`pg_is_in_recovery()` is false).
    Primary,
}

impl TargetSession {
    fn parse(value: &str) -> Result<Self, String> {
        match value {
            "any" => Ok(Self::Any),
            "read-write" => Ok(Self::ReadWrite),
            "primary" => Ok(Self::Primary),
            "read-only" | "standby" | "prefer-standby" => Err(format!(
                "target_session_attrs={value} cannot work: timeoutd writes (use read-write, primary or any)"
            )),
            other => Err(format!(
                "target_session_attrs={other:?} is not one of any, read-write, primary"
            )),
        }
    }

    /// Whether a server with these properties is acceptable.
    pub fn accepts(self, read_only: bool, in_recovery: bool) -> bool {
        match self {
            Self::Any => true,
            Self::ReadWrite => !read_only,
            Self::Primary => !in_recovery,
        }
    }
}

/// A `postgres.url` split into one complete single-host URL per host, in the order
/// given, and what a server must be to be used.
#[derive(Debug, Clone)]
pub struct PgHosts {
    pub urls: Vec<SecretUrl>,
    pub target: TargetSession,
}

/// Split libpq's multi-host URL form
/// `postgres://user:pw@h1:5432,h2:5433/db?target_session_attrs=read-write`: each host
/// (with its own port, or none for the default) gets the same user, password, database
/// and parameters. `target_session_attrs` is taken out (sqlx does not know it). Errors
/// never contain the password.
pub fn pg_hosts(raw: &str) -> Result<PgHosts, String> {
    let (scheme, rest) = raw
        .split_once("://")
        .ok_or_else(|| "not a URL (no scheme://)".to_owned())?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostlist) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let (tail, target) = take_target(tail)?;
    let urls = hostlist
        .split(',')
        .map(|host| {
            if host.is_empty() {
                return Err("an empty host in the host list".to_owned());
            }
            Ok(SecretUrl::new(format!("{scheme}://{userinfo}{host}{tail}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PgHosts { urls, target })
}

/// Remove `target_session_attrs=…` from the path-and-query part of a URL.
fn take_target(tail: &str) -> Result<(String, TargetSession), String> {
    let Some((path, query)) = tail.split_once('?') else {
        return Ok((tail.to_owned(), TargetSession::Any));
    };
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let mut target = TargetSession::Any;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", value)) => target = TargetSession::parse(value)?,
            _ => kept.push(pair),
        }
    }
    let mut out = path.to_owned();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    Ok((out, target))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposed(h: &PgHosts) -> Vec<&str> {
        h.urls.iter().map(SecretUrl::expose).collect()
    }

    #[test]
    fn one_host_is_itself() {
        let h = pg_hosts("postgres://u:p@db:5432/app?sslmode=require").expect("valid");
        assert_eq!(exposed(&h), ["postgres://u:p@db:5432/app?sslmode=require"]);
        assert_eq!(h.target, TargetSession::Any);
    }

    #[test]
    fn several_hosts_share_everything_but_host_and_port() {
        let h = pg_hosts(
            "postgresql://u:p@h1:5432,h2,[::1]:5434/app?sslmode=require&target_session_attrs=read-write",
        )
        .expect("valid");
        assert_eq!(
            exposed(&h),
            [
                "postgresql://u:p@h1:5432/app?sslmode=require",
                "postgresql://u:p@h2/app?sslmode=require",
                "postgresql://u:p@[::1]:5434/app?sslmode=require",
            ]
        );
        assert_eq!(h.target, TargetSession::ReadWrite);
    }

    #[test]
    fn target_session_attrs_values() {
        let t = |q: &str| pg_hosts(&format!("postgres://h1,h2/db?{q}")).map(|h| h.target);
        assert_eq!(
            t("target_session_attrs=primary"),
            Ok(TargetSession::Primary)
        );
        assert_eq!(t("target_session_attrs=any"), Ok(TargetSession::Any));
        assert!(t("target_session_attrs=standby").is_err());
        assert!(t("target_session_attrs=bogus").is_err());
        let h = pg_hosts("postgres://h1,h2?target_session_attrs=primary").expect("valid");
        assert_eq!(exposed(&h), ["postgres://h1", "postgres://h2"]);
    }

    #[test]
    fn an_empty_host_is_refused() {
        assert!(pg_hosts("postgres://u@h1,,h2/db").is_err());
        assert!(pg_hosts("postgres://u@h1,/db").is_err());
    }

    #[test]
    fn accepts_follows_libpq() {
        assert!(TargetSession::ReadWrite.accepts(false, true));
        assert!(!TargetSession::ReadWrite.accepts(true, false));
        assert!(TargetSession::Primary.accepts(true, false));
        assert!(!TargetSession::Primary.accepts(false, true));
        assert!(TargetSession::Any.accepts(true, true));
    }
}
