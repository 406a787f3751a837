//! [`StoreKind`]: which database a store keeps its inbox in.

use std::fmt;

/// What a store says about itself: its database's name, as `#[idempotent(store = ...)]`, error
/// messages and metric labels show it, and how a user adds one to a runtime. Core keeps no list
/// of databases; each store type carries its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreKind {
    name: &'static str,
    label: &'static str,
    constructor: &'static str,
}

impl StoreKind {
    /// A store kind: `name` as `store = ...` spells it (`"Postgres"`), `label` for metrics
    /// (`"postgres"`), and the type path a start-up error tells the user to construct
    /// (`"idem::sql::PgInbox"`).
    pub const fn new(name: &'static str, label: &'static str, constructor: &'static str) -> Self {
        Self {
            name,
            label,
            constructor,
        }
    }

    /// The name, as `store = ...` spells it.
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// The metric label.
    pub const fn label(self) -> &'static str {
        self.label
    }

    /// The type a user constructs to provide this store (`idem::sql::PgInbox`).
    pub const fn constructor(self) -> &'static str {
        self.constructor
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}
