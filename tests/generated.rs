//! Properties, generated: proptest makes keys (any UTF-8 of 1–512 bytes, NUL, control
//! characters and whitespace likely, lengths up to the limit) and AMQP properties and header
//! tables of many field types, and sends them through a runtime built with `build()` and a real
//! RabbitMQ, on PostgreSQL, MariaDB and SQLite, one message at a time and in batches. Every
//! message with a valid key is applied exactly once, its copies included; every message whose
//! key is invalid (empty, longer than 512 bytes) is dead-lettered once with its record; and the
//! queue drains. Each case also holds near-identical siblings of its keys (two keys that differ
//! only by a trailing space, a trailing NUL, the case of a letter, or the Unicode normalization
//! of a character), and each kind is asserted to occur. Dead letters are known by their message
//! id and reason, in the queue and in the store's records. The seed is printed;
//! `IDEM_PROPTEST_SEED=<n>` replays one.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::running::start;
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::{HandlerError, idempotent};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// Generated cases per test, and messages per case.
const CASES: usize = 6;
const MESSAGES: usize = 30;
const DEADLINE: Duration = Duration::from_secs(90);

/// What the handlers take: the key, and a payload that makes bodies differ.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Generated {
    key: String,
    payload: String,
}

/// The table a test's handler writes its effects to (handler state).
struct Effects(String);

/// One generated message.
#[derive(Debug, Clone)]
struct Message {
    body: Generated,
    /// Whether its key is valid (1–512 bytes).
    valid: bool,
    /// Exact copies published after it.
    copies: usize,
    message_id: Option<String>,
    correlation_id: Option<String>,
    content_type: Option<String>,
    headers: Vec<(String, AMQPValue)>,
}

/// Characters keys are made of: NUL, whitespace and control characters often, any character
/// besides.
fn key_char() -> impl Strategy<Value = char> {
    prop_oneof![
        2 => Just('\0'),
        2 => prop::sample::select(vec![' ', '\t', '\n', '\r', '\u{1}', '\u{7f}', '\u{a0}', '\u{2028}']),
        4 => prop::char::range('a', 'z'),
        4 => any::<char>(),
    ]
}

/// A string of `chars` cut to at most `bytes` bytes at a character boundary.
fn cut(chars: Vec<char>, bytes: usize) -> String {
    let mut out = String::new();
    for c in chars {
        if out.len() + c.len_utf8() > bytes {
            break;
        }
        out.push(c);
    }
    out
}

/// A valid key: 1–512 bytes, lengths near the limit as likely as short ones.
fn valid_key() -> impl Strategy<Value = String> {
    let length = prop_oneof![1usize..=16, 17usize..=500, 500usize..=512];
    (prop::collection::vec(key_char(), 1..=512), length).prop_map(|(chars, length)| {
        let key = cut(chars, length);
        if key.is_empty() { "k".to_owned() } else { key }
    })
}

/// An invalid key: empty, or longer than 512 bytes.
fn invalid_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        (prop::collection::vec(key_char(), 0..64), 513usize..=700).prop_map(|(chars, length)| {
            let mut key: String = chars.into_iter().collect();
            while key.len() < length {
                key.push('x');
            }
            key
        }),
    ]
}

/// A short string (at most 255 bytes) of any characters.
fn short_text() -> impl Strategy<Value = String> {
    (prop::collection::vec(key_char(), 0..=255), 0usize..=255).prop_map(|(c, n)| cut(c, n))
}

/// A header value of one of the field types RabbitMQ and lapin both carry.
fn header_value() -> impl Strategy<Value = AMQPValue> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<i16>().prop_map(AMQPValue::ShortInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        any::<f32>().prop_map(AMQPValue::Float),
        any::<f64>().prop_map(AMQPValue::Double),
        (any::<u8>(), any::<u32>())
            .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
        prop::collection::vec(any::<u8>(), 0..300)
            .prop_map(|bytes| AMQPValue::LongString(LongString::from(bytes))),
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|bytes| AMQPValue::ByteArray(ByteArray::from(bytes))),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        Just(AMQPValue::Void),
    ];
    leaf.prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4)
                .prop_map(|values| AMQPValue::FieldArray(FieldArray::from(values))),
            prop::collection::vec(("[a-z]{1,8}", inner), 0..4).prop_map(|fields| {
                let mut table = FieldTable::default();
                for (name, value) in fields {
                    table.insert(ShortString::from(name), value);
                }
                AMQPValue::FieldTable(table)
            }),
        ]
    })
}

fn message() -> impl Strategy<Value = Message> {
    (
        prop_oneof![9 => valid_key().prop_map(|k| (k, true)), 1 => invalid_key().prop_map(|k| (k, false))],
        short_text(),
        0usize..=2,
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::option::of(short_text()),
        prop::collection::vec((short_text().prop_filter("a name", |n| !n.is_empty()), header_value()), 0..6),
    )
        .prop_map(|((key, valid), payload, copies, message_id, correlation_id, content_type, headers)| Message {
            body: Generated { key, payload },
            valid,
            copies: if valid { copies } else { 0 },
            message_id,
            correlation_id,
            content_type,
            headers,
        })
}

/// The seed of this run: `IDEM_PROPTEST_SEED`, else the clock's.
fn seed() -> u64 {
    std::env::var("IDEM_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        })
}

/// The kinds of near-identical sibling keys: a pair of suffixes put after one base, each pair
/// two keys that differ only in the way the kind names.
const SIBLINGS: [(&str, &str, &str); 4] = [
    ("a trailing space", "x", "x "),
    ("a trailing NUL", "y", "y\0"),
    ("the case of a letter", "a", "A"),
    ("Unicode normalization", "\u{e9}", "e\u{301}"),
];

/// Adds to `case`, after each of its first valid messages, a pair of siblings of one kind
/// (rotating through [`SIBLINGS`]) made from a prefix of its key, unless `keys` holds either;
/// counts the pairs added per kind.
fn add_siblings(
    case: &mut Vec<Message>,
    keys: &mut HashSet<String>,
    kinds: &mut BTreeMap<&'static str, usize>,
) {
    let mut at = 0;
    let mut added = 0;
    while at < case.len() && added < 2 * SIBLINGS.len() {
        if !case[at].valid {
            at += 1;
            continue;
        }
        let (kind, one, other) = SIBLINGS[added % SIBLINGS.len()];
        // A base that leaves room for either suffix within 512 bytes.
        let base = cut(case[at].body.key.chars().collect(), 500);
        let pair = [format!("{base}{one}"), format!("{base}{other}")];
        if pair.iter().any(|k| keys.contains(k)) {
            at += 1;
            continue;
        }
        let siblings: Vec<Message> = pair
            .into_iter()
            .enumerate()
            .map(|(n, key)| {
                keys.insert(key.clone());
                let mut sibling = case[at].clone();
                sibling.body.payload = format!("{} sibling {n}", sibling.body.payload);
                sibling.body.key = key;
                sibling
            })
            .collect();
        case.splice(at + 1..at + 1, siblings);
        *kinds.entry(kind).or_default() += 1;
        added += 1;
        at += 3;
    }
}

/// `CASES` lists of `MESSAGES` messages, from `seed`, with no valid key twice across them,
/// siblings added (see [`add_siblings`]); and how many pairs of each kind of sibling.
fn generate(seed: u64) -> (Vec<Vec<Message>>, BTreeMap<&'static str, usize>) {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let strategy = prop::collection::vec(message(), MESSAGES);
    let mut keys = HashSet::new();
    let mut kinds = BTreeMap::new();
    let cases = (0..CASES)
        .map(|_| {
            let mut case = strategy.new_tree(&mut runner).unwrap().current();
            case.retain(|m| !m.valid || keys.insert(m.body.key.clone()));
            add_siblings(&mut case, &mut keys, &mut kinds);
            case
        })
        .collect();
    (cases, kinds)
}

/// The message id `publish` gives the message at `index` of the run: the generated one (cut to
/// fit) with the index after it, so that every message is known by its id.
fn message_id(message: &Message, index: usize) -> String {
    let id = message.message_id.clone().unwrap_or_default();
    let suffix = format!("#{index}");
    format!("{}{suffix}", cut(id.chars().collect(), 255 - suffix.len()))
}

/// Publishes every message of `case`, and each valid one's copies after it, to `queue`, with
/// its generated properties (and a unique message id suffix: dead-letter records of messages
/// with no usable key are keyed by it).
async fn publish(channel: &lapin::Channel, queue: &str, case: &[Message], first: usize) {
    for (n, message) in case.iter().enumerate() {
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(ShortString::from(name.as_str()), value.clone());
        }
        let id = message_id(message, first + n);
        let mut properties = BasicProperties::default()
            .with_message_id(ShortString::from(id))
            .with_delivery_mode(2)
            .with_headers(headers);
        if let Some(correlation) = &message.correlation_id {
            properties = properties.with_correlation_id(ShortString::from(correlation.as_str()));
        }
        if let Some(content_type) = &message.content_type {
            properties = properties.with_content_type(ShortString::from(content_type.as_str()));
        }
        let body = serde_json::to_vec(&message.body).unwrap();
        for _ in 0..=message.copies {
            channel
                .basic_publish(
                    ShortString::from(""),
                    ShortString::from(queue),
                    BasicPublishOptions::default(),
                    &body,
                    properties.clone(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }
}

macro_rules! suite {
    ($module:ident, $store:ident, $db:ty, $insert:literal, $bytes:literal, $pool:expr, $inbox:path) => {
        mod $module {
            use super::*;

            #[idempotent(store = $store, key = "m.key", queue = "idem-test-gen-unset")]
            async fn apply(
                tx: &mut sqlx::Transaction<'_, $db>,
                m: Generated,
                effects: &Effects,
            ) -> Result<(), HandlerError> {
                sqlx::query(sqlx::AssertSqlSafe(format!($insert, effects.0)))
                    .bind(m.key.as_bytes())
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn generated_keys_and_properties_one_at_a_time() {
                run(false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn generated_keys_and_properties_in_batches() {
                run(true).await;
            }

            async fn run(batch: bool) {
                let seed = seed();
                eprintln!("IDEM_PROPTEST_SEED={seed}");
                let (cases, siblings) = generate(seed);
                let all = cases.iter().flatten();
                let nul = all.clone().filter(|m| m.body.key.contains('\0')).count();
                let long = all.clone().filter(|m| m.valid && m.body.key.len() > 500).count();
                let invalid = all.clone().filter(|m| !m.valid).count();
                let headers: usize = all.clone().map(|m| m.headers.len()).sum();
                eprintln!("{} messages: {nul} keys with NUL, {long} valid keys over 500 bytes, {invalid} invalid keys, {headers} headers, siblings {siblings:?}", all.count());
                // Every class the run is meant to reach, reached (IDEM_PROPTEST_SEED replays a
                // run that missed one).
                for (class, count) in [("keys with NUL", nul), ("valid keys over 500 bytes", long), ("invalid keys", invalid), ("headers", headers)] {
                    assert!(count > 0, "no {class} generated (IDEM_PROPTEST_SEED={seed})");
                }
                for (kind, ..) in SIBLINGS {
                    assert!(siblings.get(kind).copied().unwrap_or(0) > 0, "no siblings differing by {kind} (IDEM_PROPTEST_SEED={seed})");
                }
                let (pool, _dir) = $pool;
                let mode = if batch { "b" } else { "m" };
                let table = format!("idem_gen_{}_{mode}", stringify!($module));
                let effects = format!("{table}_effects");
                let inbox = <$inbox>::new(pool.clone()).table(&table).unwrap();
                inbox.migrate().await.unwrap();
                // The store's dead-letter records, read as the operator's tools read them.
                let records_of = <$inbox>::new(pool.clone()).table(&table).unwrap();
                for statement in [
                    format!("CREATE TABLE IF NOT EXISTS {effects} (k {})", $bytes),
                    format!("DELETE FROM {effects}"),
                    format!("DELETE FROM {table}"),
                    format!("DELETE FROM {table}_dead_letters"),
                ] {
                    sqlx::query(sqlx::AssertSqlSafe(statement))
                        .execute(&pool)
                        .await
                        .unwrap();
                }
                let queue = common::unique("idem-test-gen");
                broker::declare_orders_queue(&queue).await;
                let consumer = idem::registry::find(concat!("generated::", stringify!($module), "::apply"))
                    .unwrap()
                    .consumer();
                let mut builder = idem::Runtime::builder()
                    .transport(RabbitTransport::new(RabbitConfig::new(amqp_url())))
                    .store(inbox)
                    .state(Effects(effects.clone()))
                    .handlers([consumer])
                    .handler_queue(consumer, &queue);
                if batch {
                    builder = builder.handler_batch(consumer, 10);
                }
                let running = start(builder);
                let connection = broker::connect().await;
                let channel = connection.create_channel().await.unwrap();
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                let dlq = idem::rabbitmq::dlq(&queue);
                let (mut applied, mut first) = (0usize, 0usize);
                // The dead letters expected so far: the message ids of the invalid keys.
                let mut dead_ids: Vec<String> = Vec::new();
                for case in &cases {
                    publish(&channel, &queue, case, first).await;
                    let case_dead: Vec<String> = case
                        .iter()
                        .enumerate()
                        .filter(|(_, m)| !m.valid)
                        .map(|(n, m)| message_id(m, first + n))
                        .collect();
                    first += case.len();
                    applied += case.iter().filter(|m| m.valid).count();
                    let dead = case_dead.len();
                    dead_ids.extend(case_dead.iter().cloned());
                    let (pool, effects, queue, dlq, records_of) = (&pool, &effects, &queue, &dlq, &records_of);
                    common::wait_until("the case settled", DEADLINE, || async move {
                        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                            "SELECT count(*) FROM {effects}"
                        )))
                        .fetch_one(pool)
                        .await
                        .unwrap();
                        rows as usize >= applied
                            && broker::count(dlq).await >= dead
                            && broker::count(queue).await == 0
                            && broker::unacked(queue) == 0
                    })
                    .await;
                    // Each valid key applied once, its copies and the other keys beside it.
                    let counts: Vec<(Vec<u8>, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                        "SELECT k, count(*) FROM {effects} GROUP BY k"
                    )))
                    .fetch_all(pool)
                    .await
                    .unwrap();
                    let expected: HashSet<Vec<u8>> = cases
                        .iter()
                        .take_while(|c| !std::ptr::eq(*c, case))
                        .chain(std::iter::once(case))
                        .flatten()
                        .filter(|m| m.valid)
                        .map(|m| m.body.key.as_bytes().to_vec())
                        .collect();
                    let twice: Vec<_> = counts.iter().filter(|(_, n)| *n != 1).collect();
                    assert!(twice.is_empty(), "applied more than once: {twice:?} (IDEM_PROPTEST_SEED={seed})");
                    let got: HashSet<Vec<u8>> = counts.into_iter().map(|(k, _)| k).collect();
                    assert_eq!(got, expected, "IDEM_PROPTEST_SEED={seed}");
                    // The dead letters of this case, each once, known by their ids; and the
                    // store's record of every one so far, with its reason.
                    let mut letters: Vec<String> = broker::drain(dlq)
                        .await
                        .iter()
                        .map(|m| m.message_id().unwrap_or_default())
                        .collect();
                    letters.sort();
                    let mut expected_letters = case_dead.clone();
                    expected_letters.sort();
                    assert_eq!(letters, expected_letters, "the dead letters (IDEM_PROPTEST_SEED={seed})");
                    let mut records: Vec<(Option<String>, String)> = records_of
                        .dead_letters(queue)
                        .await
                        .unwrap()
                        .into_iter()
                        .map(|r| (r.message_id, r.reason))
                        .collect();
                    records.sort();
                    let mut expected_records: Vec<(Option<String>, String)> = dead_ids
                        .iter()
                        .map(|id| (Some(id.clone()), "missing-key".to_owned()))
                        .collect();
                    expected_records.sort();
                    assert_eq!(records, expected_records, "one record per dead letter, with its reason (IDEM_PROPTEST_SEED={seed})");
                }
                broker::close(connection).await;
                running.shut_down().await;
                broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
            }
        }
    };
}

suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    "INSERT INTO {} (k) VALUES ($1)",
    "bytea",
    (common::postgres(8).await, None::<tempfile::TempDir>),
    idem::sql::PgInbox
);
suite!(
    mariadb,
    MySql,
    sqlx::MySql,
    "INSERT INTO {} (k) VALUES (?)",
    "VARBINARY(1024)",
    (common::mysql(8).await, None::<tempfile::TempDir>),
    idem::sql::MySqlInbox
);
suite!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    "INSERT INTO {} (k) VALUES (?)",
    "BLOB",
    {
        let (pool, dir) = common::sqlite(8).await;
        (pool, Some(dir))
    },
    idem::sql::SqliteInbox
);
