//! The configuration reference (docs/operating/configuration.md) against the code: every
//! key the daemon reads is listed exactly once, no listed key is unknown, and each
//! listed default is the one the binary ships (config/default.toml, which `Settings`
//! loads first and which must name every key, as unknown and missing keys are refused).

use std::collections::BTreeMap;

use timeoutd::config::{DEFAULT_TOML, Settings};

const REFERENCE: &str = "docs/operating/configuration.md";

/// `section.key` → the default as written in the TOML (strings unquoted).
fn shipped_defaults() -> BTreeMap<String, String> {
    let table: toml::Table = DEFAULT_TOML.parse().expect("config/default.toml parses");
    let mut out = BTreeMap::new();
    for (section, keys) in &table {
        let keys = keys.as_table().expect("every top-level entry is a section");
        for (key, value) in keys {
            let shown = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Array(a) if a.is_empty() => "[]".to_owned(),
                other => other.to_string(),
            };
            out.insert(format!("{section}.{key}"), shown);
        }
    }
    out
}

/// The keys `Settings` has, from the struct itself (its serialized shape).
fn settings_keys() -> Vec<String> {
    let settings = Settings::load_from(None, Vec::new()).expect("the defaults are valid");
    let value = serde_json::to_value(&settings).expect("settings serialize");
    let mut keys = Vec::new();
    for (section, fields) in value.as_object().expect("an object") {
        for key in fields.as_object().expect("sections are objects").keys() {
            keys.push(format!("{section}.{key}"));
        }
    }
    keys.sort();
    keys
}

/// The first backticked span of a table cell.
fn code(cell: &str) -> Option<&str> {
    let start = cell.find('`')? + 1;
    let len = cell[start..].find('`')?;
    Some(&cell[start..start + len])
}

/// `key` → default, from the reference's table rows whose first cell is a `key`.
fn documented() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCE))
            .expect("the configuration reference exists");
    let mut rows = Vec::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        if !line.trim_start().starts_with('|') || cells.len() < 4 {
            continue;
        }
        let Some(key) = code(cells[0]) else { continue };
        if !key.contains('.') {
            continue;
        }
        let default = code(cells[1]).unwrap_or_else(|| panic!("{key}: no `default`"));
        let default = default.trim_matches('"');
        rows.push((key.to_owned(), default.to_owned()));
    }
    rows
}

#[test]
fn the_reference_lists_every_key_once_with_its_shipped_default() {
    let shipped = shipped_defaults();
    let documented = documented();

    let mut seen = BTreeMap::new();
    for (key, default) in &documented {
        assert!(
            seen.insert(key.clone(), default.clone()).is_none(),
            "{REFERENCE}: {key} is listed twice"
        );
    }
    let missing: Vec<&String> = shipped.keys().filter(|k| !seen.contains_key(*k)).collect();
    let unknown: Vec<&String> = seen.keys().filter(|k| !shipped.contains_key(*k)).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "{REFERENCE} must list exactly the keys of config/default.toml: \
         missing {missing:?}, not keys of the code {unknown:?}"
    );
    for (key, default) in &seen {
        assert_eq!(
            default, &shipped[key],
            "{REFERENCE}: the default of {key} differs from config/default.toml"
        );
    }
}

#[test]
fn the_shipped_defaults_name_every_key_of_the_settings() {
    let shipped: Vec<String> = shipped_defaults().into_keys().collect();
    assert_eq!(
        settings_keys(),
        shipped,
        "config/default.toml and the Settings struct must have the same keys"
    );
}
