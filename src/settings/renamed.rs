//! Old key names (from before every duration was a [`DurationMs`](crate::time::DurationMs)) read as their new ones,
//! each with a warning.

/// A key that was renamed when every duration became a [`DurationMs`](crate::time::DurationMs): the old name is still
/// read (with a warning naming both), its value converted to milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RenamedKey {
    /// The old key, `section.name` (`publisher.binding_cache_secs`).
    pub(super) old: &'static str,
    /// The key it is read as (`publisher.binding_cache`).
    pub(super) new: &'static str,
    /// Milliseconds per unit of the old key's number (1000 for a `*_secs` key).
    pub(super) ms_per_unit: u64,
}

/// The old key names still accepted, each read as its new key.
pub(super) const RENAMED_KEYS: &[RenamedKey] = &[
    RenamedKey {
        old: "topology.unit_ms",
        new: "topology.unit",
        ms_per_unit: 1,
    },
    RenamedKey {
        old: "topology.max_tier_ttl_ms",
        new: "topology.max_tier_ttl",
        ms_per_unit: 1,
    },
    RenamedKey {
        old: "precision.lateness_ms",
        new: "precision.lateness",
        ms_per_unit: 1,
    },
    RenamedKey {
        old: "publisher.binding_cache_secs",
        new: "publisher.binding_cache",
        ms_per_unit: 1000,
    },
];

/// A configuration source (the file, the environment) whose old key names are read as their new
/// ones; the renamings found are recorded for the loader to warn about.
#[derive(Debug)]
pub(super) struct Renaming {
    pub(super) inner: Box<dyn config::Source + Send + Sync>,
    pub(super) found: std::sync::Arc<std::sync::Mutex<Vec<RenamedKey>>>,
}

impl config::Source for Renaming {
    fn clone_into_box(&self) -> Box<dyn config::Source + Send + Sync> {
        Box::new(Renaming {
            inner: self.inner.clone_into_box(),
            found: self.found.clone(),
        })
    }

    fn collect(&self) -> Result<config::Map<String, config::Value>, config::ConfigError> {
        // the source's keys as one tree (the environment's come as dotted paths)
        let mut root = config::Value::new(None, config::ValueKind::Table(config::Map::new()));
        self.inner.collect_to(&mut root)?;
        let mut tree = root.into_table()?;
        for key in RENAMED_KEYS {
            if rename(&mut tree, key)? {
                let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
                if !found.contains(key) {
                    found.push(*key);
                }
            }
        }
        Ok(tree)
    }
}

/// Moves `key.old` to `key.new` in `tree`, converting its number to milliseconds; whether it
/// was there. Both keys in one source is an error: which one is meant is not clear.
fn rename(
    tree: &mut config::Map<String, config::Value>,
    key: &RenamedKey,
) -> Result<bool, config::ConfigError> {
    let (section, old) = key.old.split_once('.').expect("section.key");
    let (_, new) = key.new.split_once('.').expect("section.key");
    let Some(config::Value {
        kind: config::ValueKind::Table(table),
        ..
    }) = tree.get_mut(section)
    else {
        return Ok(false);
    };
    let Some(value) = table.remove(old) else {
        return Ok(false);
    };
    if table.contains_key(new) {
        return Err(config::ConfigError::Message(format!(
            "{} and {} are both set: they are one setting ({} is its old name); keep {}",
            key.old, key.new, key.old, key.new
        )));
    }
    let origin = value.origin().map(str::to_string);
    let scaled = |n: u64| {
        n.checked_mul(key.ms_per_unit)
            .and_then(|ms| i64::try_from(ms).ok())
    };
    let kind = match value.kind {
        config::ValueKind::I64(n) if n >= 0 => scaled(n as u64).map(config::ValueKind::I64),
        config::ValueKind::U64(n) => scaled(n).map(config::ValueKind::I64),
        config::ValueKind::String(ref t) => match t.trim().parse::<u64>() {
            Ok(n) => scaled(n).map(config::ValueKind::I64),
            // a duration with its unit ("90s") means the same under either name
            Err(_) => Some(value.kind.clone()),
        },
        // negative, or not a number: DurationMs says what is wrong, under the new name
        ref other => Some(other.clone()),
    }
    .ok_or_else(|| config::ConfigError::Message(format!("{} is too large", key.old)))?;
    table.insert(new.to_string(), config::Value::new(origin.as_ref(), kind));
    Ok(true)
}
