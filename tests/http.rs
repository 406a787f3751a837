//! The `Idempotency-Key` layer over real HTTP (axum on 127.0.0.1, reqwest) and real databases:
//! PostgreSQL, MariaDB and SQLite, in both modes, with servers killed by SIGKILL mid-request.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use common::{KillOnDrop, unique, wait_until};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A request to the test handlers.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
struct Pay {
    /// Names the request's effects.
    r#ref: String,
    amount_cents: i64,
    /// Wait for the test to open the gate after the write.
    #[serde(default)]
    gated: bool,
    /// Answer this status after the write.
    #[serde(default)]
    fail: Option<u16>,
}

impl Pay {
    fn new(r#ref: &str) -> Self {
        Self {
            r#ref: r#ref.to_owned(),
            amount_cents: 100,
            gated: false,
            fail: None,
        }
    }
}

/// What the handlers share with the test.
#[derive(Clone)]
struct Probe {
    /// Handler runs that got past validation.
    runs: Arc<AtomicUsize>,
    /// Gated handlers wait for a permit.
    gate: Arc<tokio::sync::Semaphore>,
}

impl Probe {
    fn new() -> Self {
        Self {
            runs: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn open(&self) {
        self.gate.add_permits(10_000);
    }

    /// What a handler does after its write: wait, hang, or answer. A request with `x-hang`
    /// (a header: not part of the fingerprint) prints `IDEM-EXECUTING` and never answers.
    async fn after_write(&self, headers: &axum::http::HeaderMap, pay: &Pay, id: &str) -> Response {
        if headers.contains_key("x-hang") {
            println!("IDEM-EXECUTING");
            std::future::pending::<()>().await;
        }
        if pay.gated {
            let _permit = self.gate.acquire().await.unwrap();
        }
        match pay.fail {
            Some(status) => (
                StatusCode::from_u16(status).unwrap(),
                Json(serde_json::json!({"error": "refused after the write", "payment_id": id})),
            )
                .into_response(),
            None => {
                let mut response = (
                    StatusCode::CREATED,
                    [("location", format!("/payments/{id}"))],
                    Json(serde_json::json!({"payment_id": id})),
                )
                    .into_response();
                // A request with `x-cookie` gets it back as its session's cookie and header.
                if let Some(cookie) = headers.get("x-cookie") {
                    let answer = response.headers_mut();
                    answer.insert("set-cookie", cookie.clone());
                    answer.insert("x-session", cookie.clone());
                }
                response
            }
        }
    }
}

/// A validation failure, answered before anything is written.
fn invalid(pay: &Pay) -> Option<Response> {
    (pay.amount_cents <= 0)
        .then(|| (StatusCode::BAD_REQUEST, "amount_cents must be positive").into_response())
}

/// An axum server on a free port of 127.0.0.1, stopped when dropped.
struct Server {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(app: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, task }
    }

    fn url(&self) -> String {
        format!("http://{}/pay", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An answer, as the tests compare them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<String>,
    location: Option<String>,
    /// `set-cookie` and `x-session`, when answered.
    cookie: (Option<String>, Option<String>),
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

async fn post(url: &str, client: Option<&str>, key: Option<&str>, pay: &Pay) -> Answer {
    post_with(url, client, key, pay, None).await
}

/// [`post`], with an `x-cookie` header when `cookie` is given.
async fn post_with(
    url: &str,
    client: Option<&str>,
    key: Option<&str>,
    pay: &Pay,
    cookie: Option<&str>,
) -> Answer {
    let mut request = reqwest::Client::new().post(url).json(pay);
    if let Some(cookie) = cookie {
        request = request.header("x-cookie", cookie);
    }
    if let Some(client) = client {
        request = request.header("authorization", format!("Bearer {client}"));
    }
    if let Some(key) = key {
        request = request.header("idempotency-key", format!("\"{key}\""));
    }
    let response = request.send().await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    Answer {
        status: response.status().as_u16(),
        replayed: header("idempotent-replayed").as_deref() == Some("true"),
        retry_after: header("retry-after"),
        location: header("location"),
        cookie: (header("set-cookie"), header("x-session")),
        body: response.bytes().await.unwrap().to_vec(),
    }
}

/// The bearer token as the client's identity; none: 401.
fn bearer(parts: &axum::http::request::Parts) -> Option<String> {
    parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned)
}

/// The layer's counters, rendered by a Prometheus recorder installed once per test binary.
fn metrics() -> String {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .unwrap()
        })
        .render()
}

fn counted(operation: &str, result: &str) -> u64 {
    let prefix =
        format!("idem_http_requests_total{{operation=\"{operation}\",result=\"{result}\"}} ");
    metrics()
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |n| n.parse().unwrap())
}

/// One suite per database: `$db` the sqlx database, `$inbox` its inbox, `$insert` and
/// `$count` the effect statements in its placeholders.
macro_rules! suite {
    ($name:ident, $db:ty, $inbox:ty, $connect:path, $open:path, $insert:literal, $count:literal, $rows:literal, cross_process_409 = $nowait:literal) => {
        mod $name {
            use super::*;
            use idem_http::{Execution, External, Idempotency, Transactional, Tx};

            type Pool = sqlx::Pool<$db>;

            #[derive(Clone)]
            struct App {
                probe: Probe,
                pool: Pool,
            }

            /// Transactional: the effect is written in the request's transaction.
            async fn pay_in_tx(
                axum::extract::State(app): axum::extract::State<App>,
                mut tx: Tx<$db>,
                headers: axum::http::HeaderMap,
                Json(pay): Json<Pay>,
            ) -> Response {
                if let Some(refused) = invalid(&pay) {
                    return refused;
                }
                app.probe.runs.fetch_add(1, Ordering::SeqCst);
                let id = unique("pay");
                sqlx::query($insert)
                    .bind(&id)
                    .bind(&pay.r#ref)
                    .execute(&mut **tx)
                    .await
                    .unwrap();
                app.probe.after_write(&headers, &pay, &id).await
            }

            /// External: the effect is written on its own (a call to another service).
            async fn pay_outside(
                axum::extract::State(app): axum::extract::State<App>,
                headers: axum::http::HeaderMap,
                Json(pay): Json<Pay>,
            ) -> Response {
                if let Some(refused) = invalid(&pay) {
                    return (Execution::NotBegun, refused).into_response();
                }
                // Refused before any effect, but only once the gate opens.
                if headers.contains_key("x-refuse-late") {
                    let _permit = app.probe.gate.acquire().await.unwrap();
                    let refused = (StatusCode::BAD_REQUEST, "refused late");
                    return (Execution::NotBegun, refused).into_response();
                }
                app.probe.runs.fetch_add(1, Ordering::SeqCst);
                let id = unique("pay");
                sqlx::query($insert)
                    .bind(&id)
                    .bind(&pay.r#ref)
                    .execute(&app.pool)
                    .await
                    .unwrap();
                app.probe.after_write(&headers, &pay, &id).await
            }

            async fn effects(pool: &Pool, r#ref: &str) -> i64 {
                sqlx::query_scalar($count)
                    .bind(r#ref)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Rows of the inbox for an operation, any status.
            async fn rows(pool: &Pool, operation: &str) -> i64 {
                sqlx::query_scalar($rows)
                    .bind(format!("http:{operation}"))
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn setup(pool: &Pool) {
                metrics(); // the recorder, before anything is counted
                <$inbox>::new(pool.clone()).migrate().await.unwrap();
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS http_effects (id VARCHAR(100) PRIMARY KEY, \
                     ref VARCHAR(200) NOT NULL)",
                )
                .execute(pool)
                .await
                .unwrap();
            }

            fn transactional(pool: &Pool, operation: &str) -> Idempotency<$inbox, Transactional> {
                Idempotency::transactional(<$inbox>::new(pool.clone()), operation).identity(bearer)
            }

            fn external(
                pool: &Pool,
                operation: &str,
                lease: Duration,
            ) -> Idempotency<$inbox, External> {
                Idempotency::external(<$inbox>::new(pool.clone()), operation)
                    .identity(bearer)
                    .lease(lease)
            }

            /// How a configured layer goes on the `/pay` route, as a user routes it: a
            /// transactional one wraps `pay_in_tx`, an external one is a tower layer on
            /// `pay_outside`.
            trait OnRoute {
                fn route(self) -> axum::routing::MethodRouter<App>;
            }

            impl OnRoute for Idempotency<$inbox, Transactional> {
                fn route(self) -> axum::routing::MethodRouter<App> {
                    axum::routing::post(self.layer().unwrap().handler(pay_in_tx))
                }
            }

            impl OnRoute for Idempotency<$inbox, External> {
                fn route(self) -> axum::routing::MethodRouter<App> {
                    axum::routing::post(pay_outside).layer(self.layer().unwrap())
                }
            }

            async fn serve(pool: &Pool, probe: &Probe, layer: impl OnRoute) -> Server {
                let app = axum::Router::new()
                    .route("/pay", layer.route())
                    .with_state(App {
                        probe: probe.clone(),
                        pool: pool.clone(),
                    });
                Server::start(app).await
            }

            /// 100 concurrent requests with one key, split over two servers (two layers, as two
            /// processes would be): the handler runs once; each answer is its response or a 409;
            /// every later retry gets the stored response byte for byte.
            async fn one_run_under_concurrency(pool: Pool) {
                setup(&pool).await;
                let operation = unique("concurrent");
                let probe = Probe::new();
                let a = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let b = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let r#ref = unique("ref");
                let pay = Pay {
                    gated: true,
                    ..Pay::new(&r#ref)
                };
                let conflicts = Arc::new(AtomicUsize::new(0));
                let requests: Vec<_> = (0..100)
                    .map(|i| {
                        let url = if i % 2 == 0 { a.url() } else { b.url() };
                        let (pay, conflicts) = (pay.clone(), conflicts.clone());
                        tokio::spawn(async move {
                            let answer = post(&url, Some("alice"), Some("k-1"), &pay).await;
                            if answer.status == 409 {
                                conflicts.fetch_add(1, Ordering::SeqCst);
                            }
                            answer
                        })
                    })
                    .collect();
                wait_until(
                    "concurrent copies to be answered 409",
                    Duration::from_secs(30),
                    || async { probe.runs() == 1 && conflicts.load(Ordering::SeqCst) >= 10 },
                )
                .await;
                probe.open();
                let mut answers = Vec::new();
                for request in requests {
                    answers.push(request.await.unwrap());
                }
                assert_eq!(probe.runs(), 1, "the handler ran more than once");
                assert_eq!(effects(&pool, &r#ref).await, 1);
                let executed: Vec<_> = answers
                    .iter()
                    .filter(|a| a.status == 201 && !a.replayed)
                    .collect();
                assert_eq!(executed.len(), 1, "{answers:?}");
                let first = executed[0].clone();
                for answer in &answers {
                    match answer.status {
                        201 => assert_eq!(
                            (&answer.body, &answer.location),
                            (&first.body, &first.location)
                        ),
                        409 => assert!(answer.retry_after.is_some(), "{answer:?}"),
                        other => panic!("answer {other}: {answer:?}"),
                    }
                }
                for server in [&a, &b, &a] {
                    let retry = post(&server.url(), Some("alice"), Some("k-1"), &pay).await;
                    assert!(retry.replayed, "{retry:?}");
                    assert_eq!(
                        (retry.status, &retry.body, &retry.location),
                        (201, &first.body, &first.location)
                    );
                }
                assert_eq!(probe.runs(), 1);
                assert!(counted(&operation, "in_progress") >= 10);
                assert!(counted(&operation, "replayed") >= 3);
                assert_eq!(counted(&operation, "executed"), 1);
            }

            /// A key that another layer (another process) is running: 409 at once where the
            /// store can tell (PostgreSQL), else the request waits for it and gets its response.
            async fn another_process_running_the_key(pool: Pool) {
                setup(&pool).await;
                let operation = unique("other");
                let probe = Probe::new();
                let a = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let b = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let pay = Pay {
                    gated: true,
                    ..Pay::new(&unique("ref"))
                };
                let first = tokio::spawn({
                    let (url, pay) = (a.url(), pay.clone());
                    async move { post(&url, Some("alice"), Some("x"), &pay).await }
                });
                wait_until("the handler to run", Duration::from_secs(30), || async {
                    probe.runs() == 1
                })
                .await;
                let second = tokio::spawn({
                    let (url, pay) = (b.url(), pay.clone());
                    async move { post(&url, Some("alice"), Some("x"), &pay).await }
                });
                let waiting = if $nowait {
                    let busy = tokio::time::timeout(Duration::from_secs(30), second)
                        .await
                        .expect("the request waited for the key instead of answering 409")
                        .unwrap();
                    assert_eq!(busy.status, 409, "{busy:?}");
                    assert_eq!(busy.retry_after.as_deref(), Some("1"));
                    None
                } else {
                    Some(second)
                };
                probe.open();
                let first = first.await.unwrap();
                assert_eq!((first.status, first.replayed), (201, false));
                // Where it answered 409, the client retries once the first request is done.
                let second = match waiting {
                    Some(waiting) => waiting.await.unwrap(),
                    None => post(&b.url(), Some("alice"), Some("x"), &pay).await,
                };
                assert_eq!(
                    (second.status, second.replayed, &second.body),
                    (201, true, &first.body)
                );
                assert_eq!(probe.runs(), 1);
            }

            /// A mismatched request is 422, a missing or malformed key 400, and two clients with
            /// one key are two requests that never see each other's response.
            async fn keys_are_checked_and_scoped(pool: Pool) {
                setup(&pool).await;
                let operation = unique("scoped");
                let probe = Probe::new();
                let server = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let url = server.url();
                let pay = Pay::new(&unique("ref"));
                let alice = post(&url, Some("alice"), Some("k"), &pay).await;
                assert_eq!((alice.status, alice.replayed), (201, false));
                let other_body = Pay {
                    amount_cents: 200,
                    ..pay.clone()
                };
                let mismatch = post(&url, Some("alice"), Some("k"), &other_body).await;
                assert_eq!(mismatch.status, 422, "{mismatch:?}");
                assert_eq!(mismatch.json()["status"], 422);
                assert_eq!(
                    mismatch.json()["key_expires_after"],
                    24 * 3600,
                    "the expiry policy"
                );
                let missing = post(&url, Some("alice"), None, &pay).await;
                assert_eq!(missing.status, 400);
                let malformed = reqwest::Client::new()
                    .post(&url)
                    .header("authorization", "Bearer alice")
                    .header("idempotency-key", "\"unterminated")
                    .json(&pay)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(malformed.status(), 400);
                assert_eq!(post(&url, None, Some("k"), &pay).await.status, 401);
                let bob = post(&url, Some("bob"), Some("k"), &pay).await;
                assert_eq!((bob.status, bob.replayed), (201, false));
                assert_ne!(bob.body, alice.body);
                assert_eq!(probe.runs(), 2);
                assert_eq!(
                    post(&url, Some("alice"), Some("k"), &pay).await.body,
                    alice.body
                );
                assert_eq!(
                    post(&url, Some("bob"), Some("k"), &pay).await.body,
                    bob.body
                );
                assert_eq!(probe.runs(), 2);
                assert_eq!(effects(&pool, &pay.r#ref).await, 2);
                assert_eq!(counted(&operation, "mismatch"), 1);
                assert_eq!(counted(&operation, "bad_key"), 2);
            }

            /// A server error after execution began is replayed (its writes rolled back); a 4xx
            /// after it is replayed with its writes; a validation error before it is not stored.
            async fn errors_are_replayed_validation_is_not(pool: Pool) {
                setup(&pool).await;
                let operation = unique("errors");
                let probe = Probe::new();
                let server = serve(&pool, &probe, transactional(&pool, &operation)).await;
                let url = server.url();

                let failing = Pay {
                    fail: Some(500),
                    ..Pay::new(&unique("ref"))
                };
                let first = post(&url, Some("alice"), Some("e-500"), &failing).await;
                assert_eq!((first.status, first.replayed), (500, false));
                let again = post(&url, Some("alice"), Some("e-500"), &failing).await;
                assert_eq!(
                    (again.status, again.replayed, &again.body),
                    (500, true, &first.body)
                );
                assert_eq!(probe.runs(), 1);
                assert_eq!(
                    effects(&pool, &failing.r#ref).await,
                    0,
                    "a 5xx rolls the writes back"
                );

                let declined = Pay {
                    fail: Some(402),
                    ..Pay::new(&unique("ref"))
                };
                let first = post(&url, Some("alice"), Some("e-402"), &declined).await;
                let again = post(&url, Some("alice"), Some("e-402"), &declined).await;
                assert_eq!(
                    (again.status, again.replayed, &again.body),
                    (402, true, &first.body)
                );
                assert_eq!(
                    effects(&pool, &declined.r#ref).await,
                    1,
                    "a 4xx commits its writes"
                );

                let invalid = Pay {
                    amount_cents: -1,
                    ..Pay::new(&unique("ref"))
                };
                let refused = post(&url, Some("alice"), Some("e-400"), &invalid).await;
                assert_eq!((refused.status, refused.replayed), (400, false));
                let refused = post(&url, Some("alice"), Some("e-400"), &invalid).await;
                assert_eq!(
                    (refused.status, refused.replayed),
                    (400, false),
                    "not stored"
                );
                let corrected = Pay {
                    amount_cents: 5,
                    ..invalid
                };
                let accepted = post(&url, Some("alice"), Some("e-400"), &corrected).await;
                assert_eq!((accepted.status, accepted.replayed), (201, false));
                assert_eq!(probe.runs(), 3);
            }

            /// The limits and options: a long key, a large body, an optional key, the policy
            /// link, a response too large to store (rolled back; external: stored without its
            /// body), and a store that fails (503, nothing executed).
            async fn limits_and_options(pool: Pool, broken: Pool) {
                setup(&pool).await;
                let operation = unique("limits");
                let probe = Probe::new();
                let layer = transactional(&pool, &operation)
                    .max_request_bytes(1_000)
                    .policy("https://api.example/idempotency");
                let server = serve(&pool, &probe, layer).await;
                let url = server.url();
                let pay = Pay::new(&unique("ref"));
                let long = "k".repeat(256);
                let refused = post(&url, Some("alice"), Some(&long), &pay).await;
                assert_eq!(refused.status, 400);
                assert_eq!(refused.json()["type"], "https://api.example/idempotency");
                let large = Pay {
                    r#ref: "r".repeat(2_000),
                    ..pay.clone()
                };
                assert_eq!(
                    post(&url, Some("alice"), Some("big"), &large).await.status,
                    413
                );
                assert_eq!(probe.runs(), 0);

                let optional =
                    serve(&pool, &probe, transactional(&pool, &operation).optional()).await;
                // Without a key the request runs unguarded, in a transaction of its own.
                let unkeyed = post(&optional.url(), Some("alice"), None, &pay).await;
                assert_eq!(
                    post(&optional.url(), Some("alice"), None, &pay)
                        .await
                        .status,
                    201
                );
                assert_ne!(
                    unkeyed.body,
                    post(&optional.url(), Some("alice"), None, &pay).await.body
                );
                assert_eq!(effects(&pool, &pay.r#ref).await, 3);
                let keyed = post(&optional.url(), Some("alice"), Some("opt"), &pay).await;
                assert_eq!((keyed.status, keyed.replayed), (201, false));

                let small = transactional(&pool, &operation).max_response_bytes(10);
                let small = serve(&pool, &probe, small).await;
                let too_large = post(&small.url(), Some("alice"), Some("small"), &pay).await;
                assert_eq!(too_large.status, 500, "{too_large:?}");
                assert_eq!(
                    effects(&pool, &pay.r#ref).await,
                    4,
                    "only the optional route's writes"
                );
                let external_small = external(&pool, &unique("limits"), Duration::from_secs(60))
                    .max_response_bytes(10);
                let external_small = serve(&pool, &probe, external_small).await;
                let first = post(&external_small.url(), Some("alice"), Some("small"), &pay).await;
                assert_eq!((first.status, first.json().is_object()), (201, true));
                let again = post(&external_small.url(), Some("alice"), Some("small"), &pay).await;
                assert_eq!(
                    (again.status, again.replayed, again.body.len()),
                    (201, true, 0)
                );

                // The longest key the layer accepts fits every store (MySQL's key column held
                // 191 characters, the layer's prefix included, and such keys were answered 503).
                let longest = "k".repeat(255);
                let other = Pay::new(&unique("ref"));
                let taken = post(&url, Some("alice"), Some(&longest), &other).await;
                assert_eq!((taken.status, taken.replayed), (201, false), "{taken:?}");
                let again = post(&url, Some("alice"), Some(&longest), &other).await;
                assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
                assert_eq!(effects(&pool, &other.r#ref).await, 1);

                broken.close().await;
                let unavailable = serve(&broken, &probe, transactional(&broken, &operation)).await;
                let runs = probe.runs();
                let answer = post(&unavailable.url(), Some("alice"), Some("down"), &pay).await;
                assert_eq!(answer.status, 503);
                assert!(answer.retry_after.is_some());
                assert_eq!(probe.runs(), runs, "executed without its key");
            }

            /// A key expires with the layer's retention: swept, it is a new request.
            async fn keys_expire(pool: Pool) {
                setup(&pool).await;
                let operation = unique("expiry");
                let probe = Probe::new();
                let layer = transactional(&pool, &operation).retention(Duration::from_secs(1));
                let server = serve(&pool, &probe, layer).await;
                let pay = Pay::new(&unique("ref"));
                let first = post(&server.url(), Some("alice"), Some("x"), &pay).await;
                assert!(
                    post(&server.url(), Some("alice"), Some("x"), &pay)
                        .await
                        .replayed
                );
                // What a service without a Runtime spawns.
                let sweeper = tokio::spawn(idem_http::sweep_every(
                    <$inbox>::new(pool.clone()),
                    Duration::from_millis(100),
                ));
                wait_until("the key to be swept", Duration::from_secs(30), || async {
                    rows(&pool, &operation).await == 0
                })
                .await;
                sweeper.abort();
                let again = post(&server.url(), Some("alice"), Some("x"), &pay).await;
                assert_eq!((again.status, again.replayed), (201, false));
                assert_ne!(again.body, first.body);
                assert_eq!(probe.runs(), 2);
            }

            /// External mode: the key is leased while the handler runs (409 with the lease's
            /// remaining time), its response stored after; a refusal before execution frees it.
            async fn external_mode_leases_the_key(pool: Pool) {
                setup(&pool).await;
                let operation = unique("external");
                let probe = Probe::new();
                let layer = external(&pool, &operation, Duration::from_secs(60));
                let server = serve(&pool, &probe, layer).await;
                let url = server.url();
                let pay = Pay {
                    gated: true,
                    ..Pay::new(&unique("ref"))
                };
                let first = tokio::spawn({
                    let (url, pay) = (url.clone(), pay.clone());
                    async move { post(&url, Some("alice"), Some("x"), &pay).await }
                });
                wait_until("the handler to run", Duration::from_secs(30), || async {
                    probe.runs() == 1
                })
                .await;
                let busy = post(&url, Some("alice"), Some("x"), &pay).await;
                assert_eq!(busy.status, 409);
                let other = serve(
                    &pool,
                    &probe,
                    external(&pool, &operation, Duration::from_secs(60)),
                )
                .await;
                let leased = post(&other.url(), Some("alice"), Some("x"), &pay).await;
                assert_eq!(leased.status, 409, "the lease holds across layers");
                let after: u64 = leased.retry_after.as_deref().unwrap().parse().unwrap();
                assert!((50..=60).contains(&after), "Retry-After {after}");
                probe.open();
                let first = first.await.unwrap();
                assert_eq!((first.status, first.replayed), (201, false));
                let again = post(&other.url(), Some("alice"), Some("x"), &pay).await;
                assert_eq!((again.replayed, &again.body), (true, &first.body));
                assert_eq!(probe.runs(), 1);

                let invalid = Pay {
                    amount_cents: 0,
                    ..Pay::new(&unique("ref"))
                };
                assert_eq!(
                    post(&url, Some("alice"), Some("y"), &invalid).await.status,
                    400
                );
                let corrected = Pay {
                    amount_cents: 1,
                    ..invalid
                };
                let accepted = post(&url, Some("alice"), Some("y"), &corrected).await;
                assert_eq!((accepted.status, accepted.replayed), (201, false));
            }

            /// The server process killed with SIGKILL mid-request. Transactional: nothing is
            /// recorded, and a retry executes once. External: the lease is left, answered 409
            /// until it expires, then taken over.
            async fn killed_mid_request(pool: Pool, db: &str, in_tx: bool) {
                setup(&pool).await;
                let operation = unique("killed");
                let r#ref = unique("ref");
                let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                    .args([
                        "--exact",
                        concat!(stringify!($name), "::serve_child"),
                        "--include-ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("IDEM_HTTP_DB", db)
                    .env("IDEM_HTTP_OPERATION", &operation)
                    .env(
                        "IDEM_HTTP_MODE",
                        if in_tx { "transactional" } else { "external" },
                    )
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let stdout = child.stdout.take().unwrap();
                let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
                std::thread::spawn(move || {
                    use std::io::BufRead;
                    for line in std::io::BufReader::new(stdout)
                        .lines()
                        .map_while(Result::ok)
                    {
                        let _ = lines_tx.send(line);
                    }
                });
                let mut child = KillOnDrop(child);
                let addr = tokio::time::timeout(Duration::from_secs(60), async {
                    loop {
                        let line = lines.recv().await.expect("the child exited");
                        // libtest prints the test's name on the same line.
                        if let Some((_, addr)) = line.split_once("IDEM-LISTENING ") {
                            break addr.to_owned();
                        }
                    }
                })
                .await
                .unwrap();
                let pay = Pay::new(&r#ref);
                let url = format!("http://{addr}/pay");
                let hanging = tokio::spawn({
                    let pay = pay.clone();
                    async move {
                        let _ = reqwest::Client::new()
                            .post(&url)
                            .header("authorization", "Bearer alice")
                            .header("idempotency-key", "\"crash\"")
                            .header("x-hang", "1")
                            .json(&pay)
                            .send()
                            .await;
                    }
                });
                tokio::time::timeout(Duration::from_secs(60), async {
                    while !lines
                        .recv()
                        .await
                        .expect("the child exited")
                        .ends_with("IDEM-EXECUTING")
                    {}
                })
                .await
                .unwrap();
                child.0.kill().unwrap();
                child.0.wait().unwrap();
                hanging.await.unwrap();

                let probe = Probe::new();
                let retry = Pay::new(&r#ref);
                if in_tx {
                    assert_eq!(
                        rows(&pool, &operation).await,
                        0,
                        "a key recorded by a killed request"
                    );
                    assert_eq!(effects(&pool, &r#ref).await, 0);
                    let server = serve(&pool, &probe, transactional(&pool, &operation)).await;
                    let answer = post(&server.url(), Some("alice"), Some("crash"), &retry).await;
                    assert_eq!((answer.status, answer.replayed), (201, false));
                    assert_eq!(effects(&pool, &r#ref).await, 1);
                    let again = post(&server.url(), Some("alice"), Some("crash"), &retry).await;
                    assert_eq!((again.replayed, &again.body), (true, &answer.body));
                } else {
                    assert_eq!(rows(&pool, &operation).await, 1, "the lease is left");
                    assert_eq!(effects(&pool, &r#ref).await, 1);
                    let layer = external(&pool, &operation, Duration::from_secs(2));
                    let server = serve(&pool, &probe, layer).await;
                    let first = post(&server.url(), Some("alice"), Some("crash"), &retry).await;
                    assert_eq!(first.status, 409, "a live lease is taken over: {first:?}");
                    // Polls, with a deadline, until the lease (2 s) expires and is taken over.
                    let deadline = std::time::Instant::now() + Duration::from_secs(30);
                    let answer = loop {
                        let answer =
                            post(&server.url(), Some("alice"), Some("crash"), &retry).await;
                        if answer.status != 409 {
                            break answer;
                        }
                        assert!(
                            std::time::Instant::now() < deadline,
                            "the lease was never taken over"
                        );
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    };
                    assert_eq!((answer.status, answer.replayed), (201, false));
                    assert_eq!(effects(&pool, &r#ref).await, 2, "the call ran again once");
                    let again = post(&server.url(), Some("alice"), Some("crash"), &retry).await;
                    assert_eq!((again.replayed, &again.body), (true, &answer.body));
                }
                assert_eq!(probe.runs(), 1);
            }

            /// External mode: a request refused before it ran (`Execution::NotBegun`) frees its
            /// key only while it still holds it. Here its lease ran out while it waited, a retry
            /// took the key over and completed it; the refusal then leaves the retry's row, and
            /// the next retry gets the stored response instead of running again.
            #[tokio::test]
            async fn a_late_refusal_never_frees_a_key_a_retry_completed() {
                let (pool, _db) = $connect().await;
                setup(&pool).await;
                let operation = unique("late");
                let probe = Probe::new();
                let layer = external(&pool, &operation, Duration::from_millis(300));
                let server = serve(&pool, &probe, layer).await;
                // The retries come through another process's layer (this one knows the first
                // request is still in flight here, and answers 409).
                let layer = external(&pool, &operation, Duration::from_millis(300));
                let other = serve(&pool, &probe, layer).await;
                let (key, pay) = (unique("k"), Pay::new(&unique("ref")));
                let (url, retries) = (server.url(), other.url());
                let refused = {
                    let (url, key, pay) = (url.clone(), key.clone(), pay.clone());
                    tokio::spawn(async move {
                        reqwest::Client::new()
                            .post(url)
                            .json(&pay)
                            .header("authorization", "Bearer alice")
                            .header("idempotency-key", format!("\"{key}\""))
                            .header("x-refuse-late", "1")
                            .send()
                            .await
                            .unwrap()
                            .status()
                            .as_u16()
                    })
                };
                // The first request holds the key (its row is leased) ...
                wait_until(
                    "the first request holding the key",
                    Duration::from_secs(30),
                    || async { rows(&pool, &operation).await == 1 },
                )
                .await;
                // ... until its lease runs out and a retry takes the key over.
                let completed = std::sync::Mutex::new(None);
                wait_until(
                    "a retry that takes the key over",
                    Duration::from_secs(30),
                    || async {
                        let answer = post(&retries, Some("alice"), Some(&key), &pay).await;
                        let done = answer.status == 201;
                        if done {
                            *completed.lock().unwrap() = Some(answer);
                        }
                        done
                    },
                )
                .await;
                let completed = completed.into_inner().unwrap().unwrap();
                probe.open();
                assert_eq!(refused.await.unwrap(), 400);
                let again = post(&retries, Some("alice"), Some(&key), &pay).await;
                assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
                assert_eq!(again.body, completed.body);
                assert_eq!(effects(&pool, &pay.r#ref).await, 1, "the payment ran once");
            }

            /// Under one key space for every client, the first client's response sets its
            /// cookie (and a session header the layer is told never to store); the second
            /// client, retrying the same key, gets the stored response without either.
            #[tokio::test]
            async fn a_cookie_is_never_stored_nor_replayed() {
                let (pool, _db) = $connect().await;
                setup(&pool).await;
                let operation = unique("cookie");
                let probe = Probe::new();
                fn cookieless<M>(layer: Idempotency<$inbox, M>) -> Idempotency<$inbox, M> {
                    layer
                        .shared_key_space()
                        .never_store_header(axum::http::HeaderName::from_static("x-session"))
                }
                for in_tx in [true, false] {
                    let store = <$inbox>::new(pool.clone());
                    let server = match in_tx {
                        true => {
                            let layer = Idempotency::transactional(store, &operation);
                            serve(&pool, &probe, cookieless(layer)).await
                        }
                        false => {
                            let layer = Idempotency::external(store, &operation);
                            serve(&pool, &probe, cookieless(layer)).await
                        }
                    };
                    let key = unique("k");
                    let pay = Pay::new(&unique("ref"));
                    let first =
                        post_with(&server.url(), None, Some(&key), &pay, Some("session=alice"))
                            .await;
                    assert_eq!((first.status, first.replayed), (201, false));
                    let alice = Some("session=alice".to_owned());
                    assert_eq!(
                        first.cookie,
                        (alice.clone(), alice),
                        "the first client gets its own"
                    );
                    let second = post(&server.url(), None, Some(&key), &pay).await;
                    assert_eq!((second.status, second.replayed), (201, true));
                    assert_eq!(second.cookie, (None, None), "never another client's cookie");
                    assert_eq!(second.body, first.body);
                }
            }

            #[tokio::test]
            async fn one_run_under_100_concurrent_requests() {
                let (pool, _db) = $connect().await;
                one_run_under_concurrency(pool).await;
            }

            #[tokio::test]
            async fn a_key_another_process_runs() {
                let (pool, _db) = $connect().await;
                another_process_running_the_key(pool).await;
            }

            #[tokio::test]
            async fn keys_are_checked_and_scoped_by_client() {
                let (pool, _db) = $connect().await;
                keys_are_checked_and_scoped(pool).await;
            }

            #[tokio::test]
            async fn errors_after_execution_are_replayed_validation_is_not_stored() {
                let (pool, _db) = $connect().await;
                errors_are_replayed_validation_is_not(pool).await;
            }

            #[tokio::test]
            async fn limits_options_and_a_failing_store() {
                let (pool, _db) = $connect().await;
                let (broken, _broken_db) = $connect().await;
                limits_and_options(pool, broken).await;
            }

            #[tokio::test]
            async fn keys_expire_with_the_retention() {
                let (pool, _db) = $connect().await;
                keys_expire(pool).await;
            }

            #[tokio::test]
            async fn external_mode_leases_the_key_and_answers_409() {
                let (pool, _db) = $connect().await;
                external_mode_leases_the_key(pool).await;
            }

            #[tokio::test]
            async fn transactional_server_killed_mid_request_records_nothing() {
                let (pool, db) = $connect().await;
                killed_mid_request(pool, &db.name(), true).await;
            }

            #[tokio::test]
            async fn external_server_killed_mid_request_is_taken_over_after_the_lease() {
                let (pool, db) = $connect().await;
                killed_mid_request(pool, &db.name(), false).await;
            }

            /// The server `killed_mid_request` kills.
            #[tokio::test]
            #[ignore = "child process of the kill tests"]
            async fn serve_child() {
                let pool = $open(&std::env::var("IDEM_HTTP_DB").unwrap()).await;
                let operation = std::env::var("IDEM_HTTP_OPERATION").unwrap();
                let in_tx = std::env::var("IDEM_HTTP_MODE").unwrap() == "transactional";
                let server = match in_tx {
                    true => serve(&pool, &Probe::new(), transactional(&pool, &operation)).await,
                    false => {
                        let layer = external(&pool, &operation, Duration::from_secs(2));
                        serve(&pool, &Probe::new(), layer).await
                    }
                };
                println!("IDEM-LISTENING {}", server.addr);
                let _ = &server;
                std::future::pending::<()>().await;
            }
        }
    };
}

suite!(
    postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    databases::postgres,
    databases::open_postgres,
    "INSERT INTO http_effects (id, ref) VALUES ($1, $2)",
    "SELECT count(*) FROM http_effects WHERE ref = $1",
    "SELECT count(*) FROM idem_inbox WHERE consumer = $1",
    cross_process_409 = true
);
suite!(
    mysql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    databases::mysql,
    databases::open_mysql,
    "INSERT INTO http_effects (id, ref) VALUES (?, ?)",
    "SELECT count(*) FROM http_effects WHERE ref = ?",
    "SELECT count(*) FROM idem_inbox WHERE consumer = ?",
    cross_process_409 = false
);
suite!(
    sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    databases::sqlite,
    databases::open_sqlite,
    "INSERT INTO http_effects (id, ref) VALUES ($1, $2)",
    "SELECT count(*) FROM http_effects WHERE ref = $1",
    "SELECT count(*) FROM idem_inbox WHERE consumer = $1",
    cross_process_409 = false
);

/// The databases of the suites: a pool, and the name a child process opens it by.
mod databases {
    use super::common;

    /// What names a test's database for a child process (and keeps SQLite's file alive).
    pub enum Db {
        Server(String),
        File(tempfile::TempDir),
    }

    impl Db {
        pub fn name(&self) -> String {
            match self {
                Self::Server(url) => url.clone(),
                Self::File(dir) => dir.path().join("idem.db").to_string_lossy().into_owned(),
            }
        }
    }

    pub async fn postgres() -> (sqlx::PgPool, Db) {
        (
            common::postgres(10).await,
            Db::Server(common::postgres_url()),
        )
    }

    pub async fn open_postgres(_: &str) -> sqlx::PgPool {
        common::postgres(4).await
    }

    pub async fn mysql() -> (sqlx::MySqlPool, Db) {
        (common::mysql(10).await, Db::Server(common::mysql_url()))
    }

    pub async fn open_mysql(_: &str) -> sqlx::MySqlPool {
        common::mysql(4).await
    }

    pub async fn sqlite() -> (sqlx::SqlitePool, Db) {
        let (pool, dir) = common::sqlite(8).await;
        (pool, Db::File(dir))
    }

    pub async fn open_sqlite(path: &str) -> sqlx::SqlitePool {
        common::sqlite_at(std::path::Path::new(path), 4).await
    }
}

/// `cargo run --example payments`, as its README section describes it: one payment per key, the
/// same answer replayed (also to the client's refreshed token), 422, 400 and 401.
#[tokio::test]
async fn the_payments_example_takes_one_payment_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("payments.db");
    let example = common::example("payments");
    let mut child = std::process::Command::new(&example)
        .env("PAYMENTS_ADDR", "127.0.0.1:0")
        .env("DATABASE_URL", format!("sqlite://{}", db.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e} (`cargo test` builds it)", example.display()));
    let stdout = child.stdout.take().unwrap();
    let _child = KillOnDrop(child);
    let url = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| {
                let (_, rest) = line.split_once("serving POST ")?;
                Some(rest.split_whitespace().next()?.to_owned())
            })
    });
    let url = tokio::time::timeout(Duration::from_secs(60), url)
        .await
        .unwrap()
        .unwrap()
        .expect("the example printed where it serves");
    let send = |token: Option<&'static str>, key: Option<&'static str>, body: serde_json::Value| {
        let url = url.clone();
        async move {
            let mut request = reqwest::Client::new().post(&url).json(&body);
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            let response = request.send().await.unwrap();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status().as_u16();
            (status, replayed, response.bytes().await.unwrap())
        }
    };
    let order = serde_json::json!({"customer": "alice", "amount_cents": 1250});
    let (status, replayed, first) = send(Some("alice"), Some("\"order-1\""), order.clone()).await;
    assert_eq!((status, replayed), (201, false));
    let payment: serde_json::Value = serde_json::from_slice(&first).unwrap();
    assert!(payment["payment_id"].is_string());
    let (status, replayed, again) = send(Some("alice"), Some("\"order-1\""), order.clone()).await;
    assert_eq!((status, replayed, &again), (201, true, &first));
    // A refreshed token of the same client: the same principal, the same payment.
    let (status, replayed, refreshed) =
        send(Some("alice.v2"), Some("\"order-1\""), order.clone()).await;
    assert_eq!((status, replayed, &refreshed), (201, true, &first));
    let other = serde_json::json!({"customer": "alice", "amount_cents": 1251});
    assert_eq!(send(Some("alice"), Some("\"order-1\""), other).await.0, 422);
    assert_eq!(send(Some("alice"), None, order.clone()).await.0, 400);
    assert_eq!(send(None, Some("\"order-1\""), order.clone()).await.0, 401);
    let invalid = serde_json::json!({"customer": "bob", "amount_cents": -5});
    assert_eq!(send(Some("bob"), Some("k"), invalid).await.0, 400);
    let (status, replayed, _) = send(Some("bob"), Some("k"), order).await;
    assert_eq!(
        (status, replayed),
        (201, false),
        "a refused request is not stored"
    );
    let pool = common::sqlite_at(&db, 1).await;
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT payment_id, customer, amount_cents FROM payments ORDER BY customer")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (rows[0].0.as_str(), rows[0].2),
        (payment["payment_id"].as_str().unwrap(), 1250)
    );
}

/// Sends `body` with the key `k-1` to `service` as a `Request<String>`: the status, whether it
/// was replayed, and the body.
async fn send_string<S>(service: &mut S, body: &str) -> (u16, bool, String)
where
    S: tower_service::Service<
            axum::http::Request<String>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        >,
{
    let request = axum::http::Request::post("/any")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "\"k-1\"")
        .body(body.to_owned())
        .unwrap();
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .unwrap();
    let response = service.call(request).await.unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status().as_u16();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Sends the body `one` twice and then `two`, all with the key `k-1`: answered `<verb> one`
/// (201), then the same replayed, then 422.
async fn once_then_replayed_then_422<S>(service: &mut S, verb: &str)
where
    S: tower_service::Service<
            axum::http::Request<String>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        >,
{
    let body = format!("{verb} one");
    assert_eq!(
        send_string(service, "one").await,
        (201, false, body.clone())
    );
    assert_eq!(send_string(service, "one").await, (201, true, body));
    assert_eq!(send_string(service, "two").await.0, 422);
}

/// Both kinds of layer are tower services over any request body, as tower-http's are: here
/// called with `Request<String>` bodies, without a router or a server. A transactional
/// handler (`layer.handler(..)`, as a service) writes in its transaction and is stored; its
/// retry is replayed without a run; the same key with another body is 422. An external layer
/// around a handler service does the same.
#[tokio::test]
async fn the_layer_takes_requests_of_any_body_type_without_a_router() {
    use axum::handler::HandlerWithoutStateExt as _;
    use idem_http::{Idempotency, Tx};
    let (pool, _db) = common::sqlite(2).await;
    idem::sql::SqliteInbox::new(pool.clone())
        .migrate()
        .await
        .unwrap();
    sqlx::query("CREATE TABLE any_body (text TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |mut tx: Tx<sqlx::Sqlite>, body: String| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO any_body (text) VALUES ($1)")
                .bind(&body)
                .execute(&mut **tx)
                .await
                .unwrap();
            (StatusCode::CREATED, format!("stored {body}"))
        }
    };
    let layer = Idempotency::transactional(idem::sql::SqliteInbox::new(pool.clone()), "any-body")
        .identity(bearer)
        .layer()
        .unwrap();
    let mut service = layer.handler(handler).into_service();
    once_then_replayed_then_422(&mut service, "stored").await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM any_body")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, 1);

    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |body: String| async move {
            calls.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, format!("sent {body}"))
        }
    };
    let layer = Idempotency::external(idem::sql::SqliteInbox::new(pool.clone()), "any-body-out")
        .identity(bearer)
        .layer()
        .unwrap();
    let mut service = tower_layer::Layer::layer(&layer, handler.into_service());
    once_then_replayed_then_422(&mut service, "sent").await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// SQLite's inbox whose first lease settlement fails as a deadlock victim's would (a transient
/// error), on the real database underneath.
#[derive(Clone)]
struct FirstSettleFails {
    inner: idem::sql::SqliteInbox,
    failed: Arc<std::sync::atomic::AtomicBool>,
}

mod first_settle_fails {
    use super::FirstSettleFails;
    use idem::ErrorClass;
    use idem::sql::SqliteInbox;
    use idem::store::{
        Claim, ClaimRequest, DeadLetterStore, InboxStore, Lease, LeaseEnd, LeaseStore, OutboxStore,
        ParkingStore, StoreError, StoreKind, StoredOutput, SweepStore,
    };
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    impl InboxStore for FirstSettleFails {
        type Tx<'c> = <SqliteInbox as InboxStore>::Tx<'c>;
        type Held = <SqliteInbox as InboxStore>::Held;
        const KIND: StoreKind = SqliteInbox::KIND;

        async fn check(&self) -> Result<(), StoreError> {
            self.inner.check().await
        }
        async fn begin(&self) -> Result<Self::Tx<'static>, StoreError> {
            self.inner.begin().await
        }
        async fn begin_on<'c>(
            &'c self,
            held: &'c mut Option<Self::Held>,
        ) -> Result<Self::Tx<'c>, StoreError> {
            self.inner.begin_on(held).await
        }
        async fn claim(
            &self,
            tx: &mut Self::Tx<'_>,
            request: &ClaimRequest<'_>,
        ) -> Result<Claim, StoreError> {
            self.inner.claim(tx, request).await
        }
        async fn complete(
            &self,
            tx: &mut Self::Tx<'_>,
            request: &ClaimRequest<'_>,
            output: &StoredOutput,
        ) -> Result<(), StoreError> {
            self.inner.complete(tx, request, output).await
        }
        async fn savepoint(&self, tx: &mut Self::Tx<'_>, first: bool) -> Result<(), StoreError> {
            self.inner.savepoint(tx, first).await
        }
        async fn rollback_to_savepoint(&self, tx: &mut Self::Tx<'_>) -> Result<(), StoreError> {
            self.inner.rollback_to_savepoint(tx).await
        }
        async fn unclaim(
            &self,
            tx: &mut Self::Tx<'_>,
            consumer: &str,
            keys: &[&str],
        ) -> Result<(), StoreError> {
            self.inner.unclaim(tx, consumer, keys).await
        }
        async fn commit(&self, tx: Self::Tx<'_>) -> Result<(), StoreError> {
            self.inner.commit(tx).await
        }
        async fn rollback(&self, tx: Self::Tx<'_>) {
            self.inner.rollback(tx).await
        }
    }

    impl LeaseStore for FirstSettleFails {
        async fn lease(
            &self,
            request: &ClaimRequest<'_>,
            owner: &str,
            lease: Duration,
        ) -> Result<Lease, StoreError> {
            self.inner.lease(request, owner, lease).await
        }
        async fn settle(
            &self,
            request: &ClaimRequest<'_>,
            owner: &str,
            end: LeaseEnd,
            output: &StoredOutput,
        ) -> Result<bool, StoreError> {
            if !self.failed.swap(true, Ordering::SeqCst) {
                return Err(StoreError::new(
                    "settle",
                    ErrorClass::Transient,
                    "deadlock detected (injected by the test)",
                ));
            }
            self.inner.settle(request, owner, end, output).await
        }
        async fn release(&self, request: &ClaimRequest<'_>, owner: &str) -> Result<(), StoreError> {
            self.inner.release(request, owner).await
        }
        async fn abandon(
            &self,
            request: &ClaimRequest<'_>,
            owner: &str,
        ) -> Result<bool, StoreError> {
            self.inner.abandon(request, owner).await
        }
    }

    impl DeadLetterStore for FirstSettleFails {}
    impl SweepStore for FirstSettleFails {}
    impl OutboxStore for FirstSettleFails {}
    impl ParkingStore for FirstSettleFails {}
}

/// In external mode the handler's effects are done when its lease is settled: a settlement
/// that fails transiently is tried again at once, so the response is recorded and a retry gets
/// it replayed, instead of waiting out the lease (409) and then running the handler again.
#[tokio::test]
async fn an_external_settlement_that_fails_transiently_is_tried_again_in_place() {
    use idem_http::Idempotency;
    use tower_service::Service as _;
    let (pool, _db) = common::sqlite(2).await;
    let inbox = idem::sql::SqliteInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let store = FirstSettleFails {
        inner: inbox,
        failed: Arc::default(),
    };
    let failed = store.failed.clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |body: String| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, format!("charged {body}"))
        }
    };
    let layer = Idempotency::external(store, "settle-again")
        .identity(bearer)
        .lease(Duration::from_secs(30))
        .layer()
        .unwrap();
    let mut service = tower_layer::Layer::layer(
        &layer,
        axum::handler::HandlerWithoutStateExt::into_service(handler),
    );
    let mut send = async || {
        let request = axum::http::Request::post("/charge")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", "\"c-1\"")
            .body(axum::body::Body::from("10"))
            .unwrap();
        std::future::poll_fn(|cx| {
            tower_service::Service::<axum::http::Request<axum::body::Body>>::poll_ready(
                &mut service,
                cx,
            )
        })
        .await
        .unwrap();
        let response = service.call(request).await.unwrap();
        let replayed = response.headers().contains_key("idempotent-replayed");
        (response.status().as_u16(), replayed)
    };
    assert_eq!(send().await, (201, false));
    assert!(failed.load(Ordering::SeqCst), "the first settlement failed");
    assert_eq!(
        send().await,
        (201, true),
        "the retry gets the recorded response"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A handler taking a `Tx` routed without a transactional layer (here behind none) cannot
/// run: 500, naming the fix, and the handler is not called.
#[tokio::test]
async fn a_tx_without_a_transactional_layer_is_a_server_error_naming_the_fix() {
    use axum::handler::HandlerWithoutStateExt as _;
    use idem_http::Tx;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |_tx: Tx<sqlx::Sqlite>, _body: String| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            StatusCode::CREATED
        }
    };
    let mut service = handler.into_service();
    let (status, replayed, body) = send_string(&mut service, "one").await;
    assert_eq!((status, replayed), (500, false));
    assert!(body.contains("layer.handler(handler)"), "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// External mode: a retention no longer than the lease is refused when the layer is built (the
/// sweeper could delete a key still in progress, and a retry would call the other services
/// again); a longer one is taken.
#[tokio::test]
async fn an_external_layer_refuses_a_retention_within_its_lease() {
    let (pool, _dir) = common::sqlite(1).await;
    let store = || idem::sql::SqliteInbox::new(pool.clone());
    let refused = match idem::http::Idempotency::external(store(), "short-retention")
        .identity(bearer)
        .lease(Duration::from_secs(120))
        .retention(Duration::from_secs(60))
        .layer()
    {
        Ok(_) => panic!("a retention within the lease was taken"),
        Err(e) => e.to_string(),
    };
    assert!(
        refused.contains("the retention (60s) must be longer than the lease (120s)"),
        "{refused}"
    );
    idem::http::Idempotency::external(store(), "long-retention")
        .identity(bearer)
        .lease(Duration::from_secs(120))
        .retention(Duration::from_secs(3600))
        .layer()
        .unwrap();
}
