//! Versioned messages: the entity a message updates and the version it carries, read from the
//! payload for `#[idempotent(version = "...", entity = "...")]`, so that a version at or below
//! the one applied is never applied.

use super::key::{KeyValue, MAX_KEY_LEN};

/// The entity a message updates and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    /// The entity (an order id, an account), scoped by the consumer like keys are.
    pub entity: String,
    /// The message's version of it.
    pub version: i64,
}

/// The payload's entity or version could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VersionError {
    /// The entity field is empty, absent or too long.
    #[error("entity field `{field}` is {problem}")]
    Entity {
        /// The field path, as written in the attribute.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The version field is absent or does not fit a signed 64-bit integer.
    #[error("version field `{field}` is {problem}")]
    Version {
        /// The field path, as written in the attribute.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// A payload field that can be a version: an integer (or an `Option` of one).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a version",
    label = "`version = ...` must name an integer field",
    note = "versions are integers that grow with each update of the entity (i64, u32, …, or an Option of one)"
)]
pub trait VersionValue {
    /// The version, `Err` with the problem when it is absent or out of range.
    fn version(&self) -> Result<i64, &'static str>;
}

macro_rules! version_value {
    ($($ty:ty),*) => {$(
        impl VersionValue for $ty {
            fn version(&self) -> Result<i64, &'static str> {
                i64::try_from(*self).map_err(|_| "larger than a signed 64-bit integer")
            }
        }
    )*};
}

version_value!(i8, i16, i32, i64, u8, u16, u32, u64, usize, isize);

impl<T: VersionValue> VersionValue for Option<T> {
    fn version(&self) -> Result<i64, &'static str> {
        self.as_ref().map_or(Err("absent (None)"), T::version)
    }
}

impl<T: VersionValue + ?Sized> VersionValue for &T {
    fn version(&self) -> Result<i64, &'static str> {
        (**self).version()
    }
}

/// The version in `value`: what `#[idempotent]` reads the version field with, so a field that
/// is not an integer is reported at `version = "..."`.
pub fn version_value<V: VersionValue + ?Sized>(value: &V) -> Result<i64, &'static str> {
    value.version()
}

/// Reads a payload's entity and version; what `#[idempotent(version = ..., entity = ...)]`
/// generates calls.
pub fn versioned<E: KeyValue + ?Sized>(
    entity: &E,
    version: Result<i64, &'static str>,
    entity_field: &'static str,
    version_field: &'static str,
) -> Result<Versioned, VersionError> {
    let problem = |problem| VersionError::Entity {
        field: entity_field,
        problem,
    };
    let entity = entity.key_text().ok_or_else(|| problem("absent (None)"))?;
    if entity.is_empty() {
        return Err(problem("empty"));
    }
    if entity.len() > MAX_KEY_LEN {
        return Err(problem("longer than 512 bytes"));
    }
    let version = version.map_err(|problem| VersionError::Version {
        field: version_field,
        problem,
    })?;
    Ok(Versioned {
        entity: entity.into_owned(),
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entity_and_version() {
        let read = |entity: Option<&str>, version: Option<u64>| {
            versioned(&entity, version_value(&version), "u.id", "u.version")
        };
        assert_eq!(
            read(Some("o-1"), Some(3)),
            Ok(Versioned {
                entity: "o-1".into(),
                version: 3
            })
        );
        assert_eq!(
            read(Some(""), Some(3)).unwrap_err().to_string(),
            "entity field `u.id` is empty"
        );
        assert_eq!(
            read(Some("o-1"), None).unwrap_err().to_string(),
            "version field `u.version` is absent (None)"
        );
        assert!(read(Some("o-1"), Some(u64::MAX)).is_err());
        assert_eq!(
            versioned("o", version_value(&-4_i32), "e", "v")
                .unwrap()
                .version,
            -4
        );
    }
}
