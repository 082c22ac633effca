//! Helpers shared by the static-check test binaries (`compose`, `deploy`):
//! reading repository files, `config/default.toml`, `docker-compose.yml`, and
//! checking that `TIMEOUTD__SECTION__KEY` variables name real configuration keys.

// Each test binary includes this module with `mod support;` and uses only a
// subset of it; the rest would be reported as dead code in that binary.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_yaml::Value;

/// Prefix of the environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "TIMEOUTD__";

/// A file of the repository, by its path relative to the crate root.
pub fn read(relative: &str) -> String {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), relative].iter().collect();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn unquote(s: &str) -> String {
    s.trim().trim_matches('"').trim_matches('\'').to_owned()
}

/// `(section, key) -> raw value` of config/default.toml, by scanning its lines.
pub fn default_toml() -> BTreeMap<(String, String), String> {
    let mut keys = BTreeMap::new();
    let mut section = String::new();
    for line in read("config/default.toml").lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = unquote(name);
        } else if let Some((key, value)) = line.split_once('=') {
            keys.insert((section.clone(), unquote(key)), unquote(value));
        }
    }
    keys
}

/// `TIMEOUTD__SECTION__KEY` → `("section", "key")`.
pub fn config_key_of_env(name: &str) -> Option<(String, String)> {
    let (section, key) = name.strip_prefix(ENV_PREFIX)?.split_once("__")?;
    Some((section.to_lowercase(), key.to_lowercase()))
}

/// Every `TIMEOUTD__…` name among `vars` is `TIMEOUTD__SECTION__KEY` for a key
/// config/default.toml defines; `origin` says where the variables were found.
pub fn assert_env_vars_name_config_keys<'a>(origin: &str, vars: impl IntoIterator<Item = &'a str>) {
    let known = default_toml();
    for env in vars.into_iter().filter(|v| v.starts_with(ENV_PREFIX)) {
        let key = config_key_of_env(env)
            .unwrap_or_else(|| panic!("{origin}: {env} is not of the form TIMEOUTD__SECTION__KEY"));
        assert!(
            known.contains_key(&key),
            "{origin}: {env} names {}.{}, which config/default.toml does not define",
            key.0,
            key.1
        );
    }
}

/// docker-compose.yml as a YAML value, with `<<: *anchor` merge keys applied.
pub fn compose() -> Value {
    let mut value: Value = serde_yaml::from_str(&read("docker-compose.yml"))
        .expect("docker-compose.yml is not valid YAML");
    value
        .apply_merge()
        .expect("docker-compose.yml: merge keys cannot be applied");
    value
}

/// The compose service `name`, or a panic naming it.
pub fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
    compose
        .get("services")
        .and_then(|services| services.get(name))
        .unwrap_or_else(|| panic!("docker-compose.yml: service {name:?} is missing"))
}
