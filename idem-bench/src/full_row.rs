//! idem's own inbox row, written by hand (`Inbox::Full` of the handwritten consumers): the
//! body's SHA-256, status, attempts, three timestamps and the `expires_at` index, claimed with
//! idem's PostgreSQL statements, a duplicate's stored fingerprint compared. What idem's
//! guarantees cost in SQL, without idem's runtime.

use crate::workload::{Order, apply};
use std::collections::HashMap;

/// The batch claim, the statement idem's PostgreSQL batch claim makes: the keys (sorted,
/// distinct) with their fingerprints inserted as completed rows; one row back for each key not
/// inserted, with its stored fingerprint.
pub(crate) const CLAIM_BATCH: &str = "WITH claimed AS (
    INSERT INTO bench_full_inbox (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
    SELECT $1, i.key, i.fingerprint, 'completed', 1, now(), now(), now() + interval '7 days'
    FROM unnest($2::text[], $3::bytea[]) AS i(key, fingerprint)
    ON CONFLICT (consumer, key) DO NOTHING
    RETURNING key
)
SELECT u.key, e.fingerprint
FROM unnest($2::text[]) AS u(key)
LEFT JOIN LATERAL (
    SELECT fingerprint FROM bench_full_inbox WHERE consumer = $1 AND key = u.key LIMIT 1
) AS e ON TRUE
WHERE NOT EXISTS (SELECT 1 FROM claimed AS c WHERE c.key = u.key)";

/// Claims a batch for `consumer` as idem does: the first copy of each key (`parsed`, with
/// `bodies` in the same order) with the SHA-256 of its body, sorted by key (one lock order for
/// batches sharing keys); a key the claim did not insert is a duplicate, or a conflict when its
/// stored fingerprint differs. Returns the new orders in delivery order.
pub(crate) async fn claim_batch<'a>(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    consumer: &str,
    bodies: &[&[u8]],
    parsed: &'a [(String, Order)],
) -> anyhow::Result<Vec<&'a Order>> {
    use sha2::Digest as _;
    let mut firsts: HashMap<&str, (usize, Vec<u8>)> = HashMap::with_capacity(parsed.len());
    for (i, ((key, _), body)) in parsed.iter().zip(bodies).enumerate() {
        firsts
            .entry(key.as_str())
            .or_insert_with(|| (i, sha2::Sha256::digest(body).to_vec()));
    }
    let mut sorted: Vec<(&str, &[u8])> = firsts
        .iter()
        .map(|(key, (_, fingerprint))| (*key, fingerprint.as_slice()))
        .collect();
    sorted.sort_unstable_by_key(|(key, _)| *key);
    let (keys, fingerprints): (Vec<&str>, Vec<&[u8]>) = sorted.into_iter().unzip();
    let existing: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(CLAIM_BATCH)
        .bind(consumer)
        .bind(&keys)
        .bind(&fingerprints)
        .fetch_all(&mut **tx)
        .await?;
    for (key, stored) in &existing {
        let conflict = match (firsts.remove(key.as_str()), stored) {
            (Some((_, fingerprint)), Some(stored)) => &fingerprint != stored,
            _ => false,
        };
        if conflict {
            tracing::warn!(key, "a key processed before with a different payload");
        }
    }
    let mut fresh: Vec<(usize, &Order)> =
        firsts.values().map(|(i, _)| (*i, &parsed[*i].1)).collect();
    fresh.sort_unstable_by_key(|(i, _)| *i);
    Ok(fresh.into_iter().map(|(_, order)| order).collect())
}

/// The per-message claim, the statement idem's PostgreSQL claim makes: one row back,
/// `claimed` or the stored fingerprint.
const CLAIM_ONE: &str = "WITH claimed AS (
    INSERT INTO bench_full_inbox (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
    VALUES ($1, $2, $3, 'completed', 1, now(), now(), now() + interval '7 days')
    ON CONFLICT (consumer, key) DO NOTHING
    RETURNING 1
)
SELECT TRUE AS claimed, NULL::bytea AS fingerprint FROM claimed
UNION ALL
SELECT FALSE, fingerprint FROM bench_full_inbox
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// Claims `key` for `consumer` with the SHA-256 of `body` and, when it is new, applies
/// `order`; a duplicate's stored fingerprint is compared (a conflict is logged where idem would
/// dead-letter it).
pub(crate) async fn claim_and_apply(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    consumer: &str,
    key: &str,
    order: &Order,
    body: &[u8],
) -> anyhow::Result<()> {
    use sha2::Digest as _;
    let fingerprint = sha2::Sha256::digest(body).to_vec();
    let (claimed, stored): (bool, Option<Vec<u8>>) = sqlx::query_as(CLAIM_ONE)
        .bind(consumer)
        .bind(key)
        .bind(&fingerprint)
        .fetch_optional(&mut **tx)
        .await?
        .unwrap_or((false, None));
    if claimed {
        apply(tx, order).await?;
    } else if stored.is_some_and(|stored| stored != fingerprint) {
        tracing::warn!(key, "a key processed before with a different payload");
    }
    Ok(())
}
