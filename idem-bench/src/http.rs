//! `idem-bench http`: the `Idempotency-Key` layer's cost. One axum server with three routes
//! doing the same write (one payment row, PostgreSQL), each on its own pool of the same size:
//! no idempotency, a handwritten "insert the key, run, store the response" in the handler's
//! transaction, and idem's transactional layer. Requests come from `concurrency` connections
//! at once, each with a fresh key; the routes take turns, `runs` times. Every run is checked:
//! one payment per request, one key row per request for the idempotent routes.

use anyhow::{Context as _, bail, ensure};
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::http::{Idempotency, Tx};
use idem::sql::PgInbox;
use sqlx::{PgPool, Postgres};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The options of `idem-bench http`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpBench {
    /// Requests per run.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Connections sending at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Runs of each route (the table shows medians).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Which routes to run (`plain`, `hand`, `idem`); each run starts with the next one in turn.
    #[arg(long, value_delimiter = ',', default_value = "plain,hand,idem")]
    routes: Vec<String>,
    /// Database connections of each route's pool.
    #[arg(long, default_value_t = 16)]
    connections: u32,
    /// The database (PostgreSQL).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
}

const INBOX: &str = "idem_bench_http_inbox";
const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS bench_payments (payment_id text PRIMARY KEY, customer text NOT NULL, amount_cents bigint NOT NULL)",
    // The handwritten route's keys: what a careful engineer writes (fingerprint, stored status
    // and body, an expiry and its index to sweep by).
    "CREATE TABLE IF NOT EXISTS bench_http_keys (client text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
        status int, body text, expires_at timestamptz NOT NULL, PRIMARY KEY (client, key))",
    "CREATE INDEX IF NOT EXISTS bench_http_keys_expires ON bench_http_keys (expires_at)",
];

#[derive(serde::Deserialize)]
struct NewPayment {
    customer: String,
    amount_cents: i64,
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

fn payment_id() -> String {
    format!("pay-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed))
}

const INSERT: &str =
    "INSERT INTO bench_payments (payment_id, customer, amount_cents) VALUES ($1, $2, $3)";

fn created(payment_id: &str) -> Response {
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "payment_id": payment_id })),
    )
        .into_response()
}

fn failed(e: sqlx::Error) -> Response {
    tracing::error!(error = %e, "bench handler failed");
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

/// No idempotency: one transaction with the payment.
async fn plain(State(pool): State<PgPool>, Json(p): Json<NewPayment>) -> Response {
    let id = payment_id();
    let done = async {
        let mut tx = pool.begin().await?;
        sqlx::query(INSERT)
            .bind(&id)
            .bind(&p.customer)
            .bind(p.amount_cents)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    };
    match done.await {
        Ok(()) => created(&id),
        Err(e) => failed(e),
    }
}

/// Handwritten: the key inserted first in the transaction (a duplicate replays the stored
/// response, a different body is 422), the payment, the response stored, one commit.
async fn handwritten(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    use sha2::Digest as _;
    let (Some(key), Some(client)) = (headers.get("idempotency-key"), headers.get("authorization"))
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Ok(p) = serde_json::from_slice::<NewPayment>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let fingerprint = sha2::Sha256::digest(&body).to_vec();
    let (key, client) = (
        String::from_utf8_lossy(key.as_bytes()).into_owned(),
        String::from_utf8_lossy(client.as_bytes()).into_owned(),
    );
    let id = payment_id();
    let done = async {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(
            "INSERT INTO bench_http_keys (client, key, fingerprint, expires_at) VALUES ($1, $2, $3, now() + interval '1 day')
             ON CONFLICT DO NOTHING",
        )
        .bind(&client)
        .bind(&key)
        .bind(&fingerprint)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if !claimed {
            let (stored, status, body): (Vec<u8>, Option<i32>, Option<String>) = sqlx::query_as(
                "SELECT fingerprint, status, body FROM bench_http_keys WHERE client = $1 AND key = $2",
            )
            .bind(&client)
            .bind(&key)
            .fetch_one(&mut *tx)
            .await?;
            tx.rollback().await?;
            let status = match stored == fingerprint {
                true => StatusCode::from_u16(status.unwrap_or(500) as u16)
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                false => StatusCode::UNPROCESSABLE_ENTITY,
            };
            return Ok::<_, sqlx::Error>((status, body.unwrap_or_default()).into_response());
        }
        sqlx::query(INSERT)
            .bind(&id)
            .bind(&p.customer)
            .bind(p.amount_cents)
            .execute(&mut *tx)
            .await?;
        let response = serde_json::json!({ "payment_id": id }).to_string();
        sqlx::query(
            "UPDATE bench_http_keys SET status = 201, body = $3 WHERE client = $1 AND key = $2",
        )
        .bind(&client)
        .bind(&key)
        .bind(&response)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(created(&id))
    };
    done.await.unwrap_or_else(failed)
}

/// idem: the layer claims the key and stores the response; the handler writes in its `Tx`.
async fn with_idem(mut tx: Tx<Postgres>, Json(p): Json<NewPayment>) -> Response {
    let id = payment_id();
    match sqlx::query(INSERT)
        .bind(&id)
        .bind(&p.customer)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await
    {
        Ok(_) => created(&id),
        Err(e) => failed(e),
    }
}

/// The three routes, each on a pool of its own.
async fn app(b: &HttpBench) -> anyhow::Result<axum::Router> {
    let pool = || crate::pool(&b.database_url, b.connections);
    let (plain_pool, hand_pool, idem_pool) = (pool().await?, pool().await?, pool().await?);
    let layer = Idempotency::transactional(PgInbox::new(idem_pool).table(INBOX)?, "bench.pay")
        .identity(|parts| {
            let value = parts.headers.get("authorization")?;
            Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
        })
        .layer()?;
    Ok(axum::Router::new()
        .route("/plain", post(plain).with_state(plain_pool))
        .route("/hand", post(handwritten).with_state(hand_pool))
        .route("/idem", post(layer.handler(with_idem))))
}

/// One run: `requests` requests over `concurrency` connections; the sorted latencies and the
/// elapsed time.
async fn load(url: String, b: &HttpBench, run: usize) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..b.concurrency)
        .map(|_| {
            let (url, next, requests) = (url.clone(), next.clone(), b.requests);
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        return Ok::<_, anyhow::Error>(latencies);
                    }
                    let body = serde_json::json!({ "customer": format!("c{}", i % 100), "amount_cents": 100 });
                    let sent = Instant::now();
                    let response = client
                        .post(&url)
                        .header("authorization", format!("Bearer client-{}", i % 64))
                        .header("idempotency-key", format!("\"run{run}-{i}\""))
                        .json(&body)
                        .send()
                        .await?;
                    let status = response.status();
                    response.bytes().await?;
                    latencies.push(sent.elapsed());
                    ensure!(status == StatusCode::CREATED, "{url} answered {status}");
                }
            })
        })
        .collect();
    let mut all = Vec::with_capacity(b.requests);
    for task in tasks {
        all.extend(task.await??);
    }
    let elapsed = start.elapsed();
    all.sort();
    Ok((all, elapsed))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

/// Checks a run's effects: one payment per request, and one key per request where keys are kept.
async fn verify(pool: &PgPool, b: &HttpBench, route: &str) -> anyhow::Result<()> {
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_payments")
        .fetch_one(pool)
        .await?;
    let keys: i64 = match route {
        "hand" => {
            sqlx::query_scalar("SELECT count(*) FROM bench_http_keys WHERE status = 201")
                .fetch_one(pool)
                .await?
        }
        "idem" => {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {INBOX} WHERE outcome IS NOT NULL"
            )))
            .fetch_one(pool)
            .await?
        }
        _ => b.requests as i64,
    };
    if payments != b.requests as i64 || keys != b.requests as i64 {
        bail!(
            "/{route}: {payments} payments and {keys} stored responses for {} requests",
            b.requests
        );
    }
    Ok(())
}

/// Runs the benchmark and prints the table.
pub async fn run(b: HttpBench) -> anyhow::Result<()> {
    let admin = crate::pool(&b.database_url, 2).await?;
    for statement in SCHEMA {
        sqlx::query(statement).execute(&admin).await?;
    }
    PgInbox::new(admin.clone()).table(INBOX)?.migrate().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = app(&b).await?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let names = [
        ("plain", "no idempotency"),
        ("hand", "handwritten key + response"),
        ("idem", "idem-http layer"),
    ];
    let mut routes = Vec::new();
    for route in &b.routes {
        match names.iter().find(|(r, _)| r == route) {
            Some(named) => routes.push(*named),
            None => bail!("unknown route {route}: plain, hand or idem"),
        }
    }
    let mut samples: Vec<Vec<(f64, Duration, Duration)>> = vec![Vec::new(); routes.len()];
    eprintln!(
        "{} requests per run, {} connections, {} runs",
        b.requests, b.concurrency, b.runs
    );
    for run in 1..=b.runs {
        for turn in 0..routes.len() {
            // Each run starts with the next route: none is always first or last.
            let i = (turn + run - 1) % routes.len();
            let (route, name) = routes[i];
            sqlx::query("TRUNCATE bench_payments, bench_http_keys")
                .execute(&admin)
                .await?;
            sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {INBOX}")))
                .execute(&admin)
                .await?;
            let (latencies, elapsed) = load(format!("http://{addr}/{route}"), &b, run)
                .await
                .with_context(|| format!("run {run} of /{route}"))?;
            verify(&admin, &b, route).await?;
            let rate = b.requests as f64 / elapsed.as_secs_f64();
            let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
            eprintln!(
                "run {run}: {name:<28} {rate:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  (effects exact)",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3
            );
            samples[i].push((rate, p50, p99));
        }
    }
    let hand = routes.iter().position(|(r, _)| *r == "hand");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rates: Vec<f64> = samples
        .iter()
        .map(|s| median(s.iter().map(|x| x.0).collect()))
        .collect();
    println!(
        "| route | req/s (median) | p50 ms | p99 ms | × handwritten |\n|---|---:|---:|---:|---:|"
    );
    for (i, (_, name)) in routes.iter().enumerate() {
        let p50 = median(samples[i].iter().map(|x| x.1.as_secs_f64() * 1e3).collect());
        let p99 = median(samples[i].iter().map(|x| x.2.as_secs_f64() * 1e3).collect());
        println!(
            "| {name} | {:.0} | {p50:.2} | {p99:.2} | {:.2} |",
            rates[i],
            hand.map_or(f64::NAN, |h| rates[i] / rates[h])
        );
    }
    Ok(())
}
