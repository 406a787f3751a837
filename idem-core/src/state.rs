//! Shared state for handlers: values given to the runtime once ([`RuntimeBuilder::state`]), one
//! per type, that a handler asks for with a parameter `name: &T`.
//!
//! [`RuntimeBuilder::state`]: crate::runtime::RuntimeBuilder::state

use std::any::{Any, TypeId, type_name};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The state values a runtime holds, one per type.
///
/// ```
/// use idem_core::state::State;
///
/// struct Mailer { from: &'static str }
/// let mut state = State::new();
/// state.insert(Mailer { from: "billing@example.com" });
/// assert_eq!(state.get::<Mailer>().map(|m| m.from), Some("billing@example.com"));
/// assert!(state.get::<String>().is_none());
/// ```
#[derive(Clone, Default)]
pub struct State {
    values: BTreeMap<TypeId, Entry>,
}

#[derive(Clone)]
struct Entry {
    name: &'static str,
    value: Arc<dyn Any + Send + Sync>,
}

/// No state: what a [`Context`] built outside a runtime holds.
pub(crate) static EMPTY: State = State::new();

impl State {
    /// No values.
    pub const fn new() -> Self {
        Self {
            values: BTreeMap::new(),
        }
    }

    /// Adds `value`, replacing the value of the same type if there was one.
    pub fn insert<T: Send + Sync + 'static>(&mut self, value: T) {
        self.values.insert(
            TypeId::of::<T>(),
            Entry {
                name: type_name::<T>(),
                value: Arc::new(value),
            },
        );
    }

    /// The value of type `T`, if one was added.
    pub fn get<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.values
            .get(&TypeId::of::<T>())
            .and_then(|entry| entry.value.downcast_ref())
    }

    /// Whether a value of type `ty` was added.
    pub fn contains(&self, ty: StateType) -> bool {
        self.values.contains_key(&ty.id)
    }

    /// The names of the types held, for messages.
    pub fn type_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.values.values().map(|entry| entry.name)
    }

    /// The first of `wanted` that is missing here.
    pub fn missing(&self, wanted: &[StateType]) -> Option<StateType> {
        wanted.iter().copied().find(|ty| !self.contains(*ty))
    }
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.type_names()).finish()
    }
}

/// A type of state a handler asks for: what `build()` checks is present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateType {
    id: TypeId,
    name: &'static str,
}

impl StateType {
    /// The state type `T`.
    pub fn of<T: ?Sized + 'static>() -> Self {
        Self {
            id: TypeId::of::<T>(),
            name: type_name::<T>(),
        }
    }

    /// Its name, as `std::any::type_name` gives it.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_per_type() {
        let mut state = State::new();
        state.insert(1_u32);
        state.insert(2_u32);
        state.insert(String::from("config"));
        assert_eq!(state.get::<u32>(), Some(&2));
        assert!(state.contains(StateType::of::<String>()));
        assert_eq!(
            state.missing(&[StateType::of::<String>(), StateType::of::<u64>()]),
            Some(StateType::of::<u64>())
        );
        assert_eq!(StateType::of::<u64>().name(), "u64");
        assert_eq!(format!("{state:?}").matches(',').count(), 1, "{state:?}");
    }
}
