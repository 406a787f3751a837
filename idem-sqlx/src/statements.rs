//! The statements of a dialect, by name: templates with `{table}` standing for the inbox table
//! and `{now}` for the dialect's current time, filled in once per inbox ([`Statements::fill`]).
//! Each field documents its bind parameters, in order.

use crate::config::TableName;
use std::sync::Arc;

/// The statements of one inbox, filled in.
pub type Prepared = Statements<Arc<str>>;

/// What a transactional claim and its bookkeeping run.
#[derive(Debug, Clone)]
pub struct Statements<S = &'static str> {
    /// Inserts the marker, doing nothing if the key exists (consumer, key, fingerprint,
    /// attempt, retention in seconds).
    pub claim: S,
    /// Like `claim`'s insert, but inserting nothing instead of waiting behind another
    /// transaction's uncommitted claim of the key (same parameters), where the dialect can
    /// tell; `existing` then reads what holds the key.
    pub try_claim: Option<S>,
    /// Reads a key's `fingerprint` and `outcome` (consumer, key); sees the latest committed row.
    pub existing: S,
    /// Stores the handler's result on a claimed row (outcome, consumer, key).
    pub complete: S,
    /// Removes a marker claimed in the current transaction (consumer, key).
    pub unclaim: S,
    /// Reads nothing, but fails unless the inbox table has the columns idem uses.
    pub probe: S,
    /// The savepoints of a batch's messages.
    pub savepoint: SavepointStatements,
    /// External mode.
    pub lease: LeaseStatements<S>,
    /// The retention sweeper.
    pub sweep: SweepStatements<S>,
    /// The poison limit's count of handler runs on redeliveries that never settled.
    pub deliveries: DeliveryStatements<S>,
    /// Dead-letter records, and what an operator reads and changes.
    pub admin: AdminStatements<S>,
    /// Set-based batch statements, for a dialect with array parameters (PostgreSQL).
    pub batch: Option<BatchStatements<S>>,
    /// Multi-row batch claims, for the dialects without array parameters (MySQL, SQLite).
    pub rows: Option<RowStatements<S>>,
    /// Entity versions, for versioned handlers.
    pub versions: VersionStatements<S>,
    /// The outbox (`{outbox}`).
    pub outbox: OutboxStatements<S>,
    /// The outbox rows the broker refused, out of the relay's way (`{outbox}_parked`).
    pub parked: ParkedStatements<S>,
    /// Parked keys and the messages parked behind them (`crate::parking`).
    pub parking: ParkingStatements<S>,
}

/// The outbox (`{outbox}`, named after the inbox: `idem_outbox` beside `idem_inbox`): staging
/// in the caller's transaction, and the relay's passes.
#[derive(Debug, Clone)]
pub struct OutboxStatements<S = &'static str> {
    /// Inserts staged messages: `{rows}` stands for their rows, each (message id, consumer,
    /// key, exchange, routing key, body, headers as JSON, correlation id, content type; empty
    /// text for none) and [`OutboxStatements::now`].
    pub stage: S,
    /// Takes the rows of some runs, in the order staged, skipping rows another pass holds:
    /// `{runs}` stands for their [`OutboxStatements::run_match`] joined with `OR`. Returns
    /// `seq`, `message_id`, `consumer`, `key`, `exchange`, `routing_key`, `body`, `headers`,
    /// `correlation_id`, `content_type`, `age_ms`.
    pub run: S,
    /// The condition matching one run: `{c}` and `{k}` stand for the placeholders of its
    /// consumer and key.
    pub run_match: &'static str,
    /// Takes the oldest rows staged longer ago than the given milliseconds (milliseconds, the
    /// number of rows), with the columns of `run`.
    pub older: S,
    /// Takes the oldest rows staged outside any handler (the number of rows), with the columns
    /// of `run`.
    pub unowned: S,
    /// Removes rows by `seq`; `{seqs}` stands for their comma-separated list, written into the
    /// text (integers), no parameters.
    pub delete: S,
    /// Removes rows by message id (a dispatch that published them from memory); `{ids}`
    /// stands for their placeholders, comma-separated.
    pub remove: S,
    /// Runs on the relay's connection before its transaction begins.
    pub prelude: Option<&'static str>,
    /// Runs in the relay's transaction before its delete: its commit need not wait for the disk (losing
    /// the removal of published rows in a database crash only sends them again, with their
    /// ids).
    pub lazy_commit: Option<&'static str>,
    /// Runs before `older` and `unowned` in the relay's transaction: the planner reads their
    /// rows in index order and stops at the limit, whatever its statistics say (an outbox's
    /// statistics are stale by nature: it is empty one minute and holds a backlog the next).
    pub in_order: Option<&'static str>,
    /// The staging time, as the dialect writes `created_at`.
    pub now: &'static str,
    /// A scheduled message's `created_at`: the time it is due, `{p}` standing for its
    /// placeholder (milliseconds since the Unix epoch). `run`, `older` and `unowned` take only
    /// rows whose `created_at` has come.
    pub at: &'static str,
    /// Tells the relays, at the commit, that rows were staged outside any handler.
    pub notify: Option<S>,
}

/// Entity versions (`{table}_versions`): raising the version applied to an entity in the
/// handler's transaction, only upwards.
#[derive(Debug, Clone)]
pub struct VersionStatements<S = &'static str> {
    /// Raises an entity's version if it is below the given one, inserting it where the dialect
    /// can in one statement; changes one row when it raised or inserted (consumer, entity,
    /// version).
    pub advance: S,
    /// Inserts the first version of an entity, nothing if it has one; for a dialect whose
    /// `advance` only updates (same parameters).
    pub insert: Option<S>,
    /// Reads the applied `version` with the latest committed row (consumer, entity).
    pub read: S,
}

/// The savepoint each message of a batch runs under. No parameters; may hold several
/// statements.
#[derive(Debug, Clone, Copy)]
pub struct SavepointStatements {
    /// Starts the first message's savepoint.
    pub first: &'static str,
    /// Ends one message's savepoint and starts the next one's, in one round trip.
    pub next: &'static str,
    /// Undoes the current message; the savepoint stays, for the next message.
    pub rollback: &'static str,
}

/// The probe of dialects that quote identifiers with double quotes.
pub const PROBE: &str = r#"SELECT i.consumer, i.key, i.fingerprint, i.status, i.outcome, i.attempts, i.created_at,
    i.completed_at, i.expires_at, i.owner, i.locked_until, d.deliveries, d.expires_at,
    l.keyed, l.queue, l.reason, l.detail, l.attempts, l.message_id, l.fingerprint, l.dead_lettered_at,
    v.entity, v.version, v.updated_at, o.seq, o.message_id, o.consumer, o.key, o.exchange,
    o.routing_key, o.body, o.headers, o.correlation_id, o.content_type, o.created_at,
    p.seq, p.parked_at, p.failure, p.given_up_at
    FROM "{table}" i, "{table}_deliveries" d, "{table}_dead_letters" l, "{table}_versions" v,
    "{outbox}" o, "{outbox}_parked" p
    WHERE 1 = 0"#;

/// The savepoints of dialects that release one before starting the next.
pub const SAVEPOINTS: SavepointStatements = SavepointStatements {
    first: "SAVEPOINT idem_message",
    next: "RELEASE SAVEPOINT idem_message; SAVEPOINT idem_message",
    rollback: "ROLLBACK TO SAVEPOINT idem_message",
};

/// External mode: a claim inserts the row `in_progress` with a lease, or takes an expired lease
/// over, or reads what holds the key, in one short transaction of its own; the handler's end
/// then settles the row.
#[derive(Debug, Clone)]
pub struct LeaseStatements<S = &'static str> {
    /// (consumer, key, fingerprint, retention in seconds, owner, lease in milliseconds).
    pub insert: S,
    /// Takes an expired lease with the same fingerprint over (owner, lease in milliseconds,
    /// consumer, key, fingerprint).
    pub takeover: S,
    /// Reads `status`, `attempts`, `fingerprint`, `outcome`, `remaining_ms` (consumer, key).
    pub read: S,
    /// Ends the owner's lease as completed or failed (status, outcome, consumer, key, owner).
    pub settle: S,
    /// Gives the owner's lease up (consumer, key, owner).
    pub release: S,
    /// Removes the key's row while the owner still holds it in progress (consumer, key, owner).
    pub abandon: S,
}

/// The retention sweeper: deletes expired rows in bounded batches through the index on
/// `expires_at`, under a lock that lets one sweeper work at a time across processes.
#[derive(Debug, Clone)]
pub struct SweepStatements<S = &'static str> {
    /// Tries to take the sweeper lock: one integer, 1 when taken.
    pub lock: S,
    /// Releases it.
    pub unlock: S,
    /// Deletes one batch of expired rows, oldest first (the batch size).
    pub delete: S,
    /// One integer: milliseconds since the oldest expired row left expired (0 when none is).
    pub lag: S,
    /// Deletes one batch of expired delivery counts (the batch size).
    pub delete_deliveries: S,
    /// One integer: the inbox's rows, estimated from the table's statistics where the
    /// database keeps them.
    pub rows: S,
    /// One integer: the age in milliseconds of the row that expires first (0 when empty).
    pub oldest: S,
    /// One integer: expired rows not yet deleted, counted up to 1,000,000.
    pub expired: S,
}

/// The poison limit: per (consumer, key), how many runs of its handler on redeliveries started
/// and never settled, in the table `{table}_deliveries`, expiring with the inbox rows (removed
/// by `forget_deliveries` of [`AdminStatements`] when a delivery settles).
#[derive(Debug, Clone)]
pub struct DeliveryStatements<S = &'static str> {
    /// Adds one to the count, creating it at 1 (consumer, key, retention in seconds); where
    /// `read` is `None`, returns the count in its first column.
    pub count: S,
    /// Reads the count in its first column (consumer, key), for a dialect whose `count`
    /// returns nothing.
    pub read: Option<S>,
    /// Takes one back from the count, never below 0 (consumer, key).
    pub uncount: S,
}

/// Dead-letter records (`{table}_dead_letters`, one per consumer and key) and the operator's
/// statements (the `idem` CLI). Times are read as milliseconds since the Unix epoch, `0` for
/// none; a message id is written as text, empty for none.
#[derive(Debug, Clone)]
pub struct AdminStatements<S = &'static str> {
    /// Records a dead letter, replacing the record of its key but keeping the earliest first
    /// failure (consumer, key, keyed as 0 or 1, queue, reason, detail, attempts, message id,
    /// fingerprint, first failure in milliseconds or 0 for now, retention in milliseconds or
    /// 0 for unknown).
    pub record: S,
    /// Reads the records of a queue, oldest first (the queue): `consumer`, `key`, `keyed`,
    /// `queue`, `reason`, `detail`, `attempts`, `message_id`, `fingerprint`, `at_ms`,
    /// `first_ms` and `retention_ms` (0 for none).
    pub dead_letters: S,
    /// Reads the record of a key (consumer, key), with the columns of `dead_letters`.
    pub dead_letter_of: S,
    /// Removes the record of a key (consumer, key).
    pub forget_dead_letter: S,
    /// Removes the record of a key if it is still the one written at `at_ms` (consumer, key,
    /// `at_ms` as read): not one a later failure wrote since.
    pub forget_dead_letter_at: S,
    /// Rows per consumer and status: `consumer`, `status`, `row_count`, `oldest_ms`, `expired`.
    pub stats: S,
    /// Records per consumer: `consumer`, `row_count`, `oldest_ms`.
    pub dead_letter_stats: S,
    /// One row (consumer, key): `status`, `attempts`, `outcome`, `fingerprint`, `created_ms`,
    /// `completed_ms`, `expires_ms`, `owner`, `locked_ms`.
    pub show: S,
    /// A key's count of deliveries without a settlement, in its first column (consumer, key);
    /// no row when there is none.
    pub deliveries_of: S,
    /// Removes a row (consumer, key).
    pub forget: S,
    /// Removes a row that records a failure (consumer, key).
    pub forget_failed: S,
    /// Removes a key's count of deliveries (consumer, key).
    pub forget_deliveries: S,
}

/// A batch's claims with array parameters.
#[derive(Debug, Clone)]
pub struct BatchStatements<S = &'static str> {
    /// Inserts the keys that are new and reads the keys that existed, in one statement
    /// (consumer, keys, fingerprints, attempts, retention in seconds): returns `key`,
    /// `claimed`, `fingerprint`, `outcome`, one row per key inserted or seen existing.
    pub claim: S,
    /// Reads `key`, `fingerprint`, `outcome` of keys `claim` returned no row for: committed
    /// after its snapshot was taken (consumer, keys).
    pub existing: S,
    /// Stores the results (consumer, keys, outcomes).
    pub complete: S,
}

/// A batch's claim in two multi-row statements, put together per batch from these pieces (see
/// `claim::claim_rows`): the markers inserted, each naming the batch's claim token in `owner`,
/// existing keys skipped; then every key of the batch read with a locking read, the rows that
/// carry the token being the ones this claim inserted.
#[derive(Debug, Clone)]
pub struct RowStatements<S = &'static str> {
    /// The insert, up to `VALUES`.
    pub insert: S,
    /// One row of the insert (consumer, key, fingerprint, attempt, retention in seconds, claim
    /// token).
    pub row: S,
    /// After the rows: what makes the insert skip the keys that exist.
    pub insert_end: S,
    /// The read of `key`, `fingerprint`, `outcome` and `ours` (1 where the row carries the
    /// token), up to the keys' list (claim token, consumer, then the keys).
    pub read: S,
    /// After the keys' placeholders.
    pub read_end: S,
}

/// The schema of the inbox table and the statements that keep its version.
#[derive(Debug, Clone, Copy)]
pub struct MigrationStatements {
    /// The schema versions: `(version, statements)`, with `{table}` for the inbox table.
    pub steps: &'static [(i32, &'static [&'static str])],
    /// Runs before the migration transaction.
    pub prepare: Option<&'static str>,
    /// Runs first inside the migration transaction, serializing concurrent migrations.
    pub lock: Option<&'static str>,
    /// Releases a session-level `lock`, last on the migration's connection.
    pub unlock: Option<&'static str>,
    /// Creates the schema version table.
    pub version_table: &'static str,
    /// Reads a table's `version` (the table).
    pub read_version: &'static str,
    /// Records a table's version (the table, the version).
    pub write_version: &'static str,
    /// Reads the server's version (a text column `version`), for [`MigrationStatements::server`].
    pub server_version: Option<&'static str>,
    /// Refuses a server the dialect's statements do not run on, saying why and what to use;
    /// given what [`MigrationStatements::server_version`] read.
    pub server: Option<ServerCheck>,
}

/// Refuses a server a dialect does not run on (see [`MigrationStatements::server`]): given the
/// server's version, why not and what to use instead.
pub type ServerCheck = fn(&str) -> Result<(), String>;

impl Statements {
    /// These statements for the inbox in `table`, with `now` as the current time.
    pub fn fill(&self, table: &TableName, now: &str) -> Prepared {
        let fill = |template: &str| fill(template, table, now);
        Statements {
            claim: fill(self.claim),
            try_claim: self.try_claim.map(fill),
            existing: fill(self.existing),
            complete: fill(self.complete),
            unclaim: fill(self.unclaim),
            probe: fill(self.probe),
            savepoint: self.savepoint,
            lease: LeaseStatements {
                insert: fill(self.lease.insert),
                takeover: fill(self.lease.takeover),
                read: fill(self.lease.read),
                settle: fill(self.lease.settle),
                release: fill(self.lease.release),
                abandon: fill(self.lease.abandon),
            },
            sweep: SweepStatements {
                lock: fill(self.sweep.lock),
                unlock: fill(self.sweep.unlock),
                delete: fill(self.sweep.delete),
                lag: fill(self.sweep.lag),
                delete_deliveries: fill(self.sweep.delete_deliveries),
                rows: fill(self.sweep.rows),
                oldest: fill(self.sweep.oldest),
                expired: fill(self.sweep.expired),
            },
            deliveries: DeliveryStatements {
                count: fill(self.deliveries.count),
                read: self.deliveries.read.map(fill),
                uncount: fill(self.deliveries.uncount),
            },
            admin: AdminStatements {
                record: fill(self.admin.record),
                dead_letters: fill(self.admin.dead_letters),
                dead_letter_of: fill(self.admin.dead_letter_of),
                forget_dead_letter: fill(self.admin.forget_dead_letter),
                forget_dead_letter_at: fill(self.admin.forget_dead_letter_at),
                stats: fill(self.admin.stats),
                dead_letter_stats: fill(self.admin.dead_letter_stats),
                show: fill(self.admin.show),
                deliveries_of: fill(self.admin.deliveries_of),
                forget: fill(self.admin.forget),
                forget_failed: fill(self.admin.forget_failed),
                forget_deliveries: fill(self.admin.forget_deliveries),
            },
            versions: VersionStatements {
                advance: fill(self.versions.advance),
                insert: self.versions.insert.map(fill),
                read: fill(self.versions.read),
            },
            batch: self.batch.as_ref().map(|batch| BatchStatements {
                claim: fill(batch.claim),
                existing: fill(batch.existing),
                complete: fill(batch.complete),
            }),
            outbox: OutboxStatements {
                stage: fill(self.outbox.stage),
                run: fill(self.outbox.run),
                run_match: self.outbox.run_match,
                older: fill(self.outbox.older),
                unowned: fill(self.outbox.unowned),
                notify: self.outbox.notify.map(fill),
                delete: fill(self.outbox.delete),
                remove: fill(self.outbox.remove),
                prelude: self.outbox.prelude,
                lazy_commit: self.outbox.lazy_commit,
                in_order: self.outbox.in_order,
                now: self.outbox.now,
                at: self.outbox.at,
            },
            parked: ParkedStatements {
                park: fill(self.parked.park),
                list: fill(self.parked.list),
                unpark: fill(self.parked.unpark),
                remove: fill(self.parked.remove),
                due: fill(self.parked.due),
                give_up: fill(self.parked.give_up),
            },
            parking: self.parking.fill(fill),
            rows: self.rows.as_ref().map(|rows| RowStatements {
                insert: fill(rows.insert),
                row: fill(rows.row),
                insert_end: fill(rows.insert_end),
                read: fill(rows.read),
                read_end: fill(rows.read_end),
            }),
        }
    }
}

/// Fills the table name and the current time into a template. The name is a validated
/// identifier (see [`TableName`]), so the text is safe to hand to `sqlx::AssertSqlSafe`.
pub(crate) fn fill(template: &str, table: &TableName, now: &str) -> Arc<str> {
    template
        .replace("{now}", now)
        .replace("{outbox}", &table.outbox())
        .replace("{table}", table.as_str())
        .into()
}

/// The statements of the parked rows. Times are read as milliseconds since the Unix epoch.
#[derive(Debug, Clone)]
pub struct ParkedStatements<S = &'static str> {
    /// Copies an outbox row into the parked rows (the failure, the row's `seq`).
    pub park: S,
    /// Lists the parked rows, oldest first: `seq`, `message_id`, `consumer`, `key`,
    /// `exchange`, `routing_key`, `failure`, `parked_ms`.
    pub list: S,
    /// Copies a parked row back into the outbox, with its id and staging time (its `seq`); a
    /// row whose id the outbox holds again (it was staged anew while parked) is merged into
    /// that one: nothing is inserted, and the id goes out once.
    pub unpark: S,
    /// Removes a parked row (its `seq`).
    pub remove: S,
    /// Takes the `seq` of rows parked longer ago than the given milliseconds, oldest first
    /// (milliseconds, the number of rows), skipping rows another pass holds where the dialect
    /// can, and rows given up.
    pub due: S,
    /// Gives up the parked rows staged longer ago than the given milliseconds: they are outbox
    /// dead letters from then on, released only by an operator.
    pub give_up: S,
}

/// The parked keys' statements (`crate::parking`); each documents its bind parameters, in order.
#[derive(Debug, Clone)]
pub struct ParkingStatements<S = &'static str> {
    /// Reads a key's `state`, `head_message_id` and `parked_ms`, holding its row (consumer,
    /// order key).
    pub lock: S,
    /// Reads a key's `state` and `head_message_id`, without a lock (consumer, order key).
    pub read: S,
    /// Parks a key, or parks it again behind a new head (consumer, order key, head message
    /// id, queue, source, reason, parked ms).
    pub park: S,
    /// Marks a key `releasing` (consumer, order key).
    pub releasing: S,
    /// Removes a key's row (consumer, order key).
    pub free: S,
    /// The first parked message of a key: `seq`, `fingerprint` (consumer, order key).
    pub lowest: S,
    /// The first parked message of a key but one, with its key's `parked_ms`: the columns of
    /// a message (consumer, order key, the `seq` left out).
    pub next: S,
    /// A parked message's `seq`, if it is the one named (seq, consumer, order key,
    /// fingerprint).
    pub find: S,
    /// A parked message's `seq` with a message id (consumer, order key, message id).
    pub find_id: S,
    /// Parks a message (consumer, order key, place, message id, correlation id, content
    /// type, published ms, body, headers, fingerprint, parked ms).
    pub insert: S,
    /// Removes a parked message (seq, consumer, order key, fingerprint).
    pub remove: S,
    /// How many messages a key holds: `n` (consumer, order key).
    pub remaining: S,
    /// Every parked key with its depth, oldest first: `consumer`, `order_key`, `state`,
    /// `head_message_id`, `queue`, `source`, `reason`, `parked_ms`, `depth`.
    pub list: S,
    /// Keeps a skipped head (consumer, order key, message id, reason, skipped ms, body).
    pub skipped: S,
    /// A consumer's parked keys: how many, `n`, and when the oldest was parked, `oldest`
    /// (0: none) (consumer).
    pub summary: S,
}

impl ParkingStatements {
    /// These statements for the inbox in `table`.
    pub(crate) fn fill(&self, fill: impl Fn(&str) -> Arc<str>) -> ParkingStatements<Arc<str>> {
        ParkingStatements {
            lock: fill(self.lock),
            read: fill(self.read),
            park: fill(self.park),
            releasing: fill(self.releasing),
            free: fill(self.free),
            lowest: fill(self.lowest),
            next: fill(self.next),
            find: fill(self.find),
            find_id: fill(self.find_id),
            insert: fill(self.insert),
            remove: fill(self.remove),
            remaining: fill(self.remaining),
            list: fill(self.list),
            skipped: fill(self.skipped),
            summary: fill(self.summary),
        }
    }
}
