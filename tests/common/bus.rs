//! The broker a chaos run drives, RabbitMQ or NATS JetStream: declaring the orders queue,
//! publishing the workload, counting and reading dead letters, taking the consumers'
//! connections away, and cleaning up.
#![allow(dead_code)]

use super::broker;
use super::nats_cluster::NatsCluster;
use super::nats_node::NatsNode;
use super::proxy::Proxy;
use async_nats::jetstream::{self, Context as JetStream};
use idem::RuntimeBuilder;
use idem::nats::{NatsConfig, NatsTransport};
use idem::rabbitmq::{Publisher, QueueType, RabbitConfig, RabbitTransport};
use idem::transport::{QueueSpec, Transport};
use idem::{Envelope, RetryPolicy};
use std::process::Command;
use std::time::Duration;

/// The server NATS tests use: `NATS_URL`, or the development machine's.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A JetStream context on the test server, or a failure saying how to start one.
pub async fn jetstream_or_fail() -> JetStream {
    let url = nats_url();
    let connected = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&url)).await;
    match connected {
        Ok(Ok(client)) => jetstream::new(client),
        other => panic!(
            "NATS is not reachable at {url} ({other:?}): start it with JetStream \
             (`docker compose up -d nats`, or `nats-server -js -sd <a directory>`), or point NATS_URL at one"
        ),
    }
}

/// One dead letter as a run checks it.
pub struct Letter {
    pub message_id: Option<String>,
    pub body: Vec<u8>,
    /// The reason code, where the transport puts it on the message (always on NATS; on
    /// RabbitMQ only when the store could not record it).
    pub reason: Option<String>,
    /// Where the broker names the copy apart from its message (NATS: its `Nats-Msg-Id` and the
    /// time the stream stored it), for a failing run's report.
    pub copy: Option<String>,
}

pub enum Bus {
    Rabbit {
        urls: String,
        queue_type: QueueType,
        publisher: Box<Publisher>,
    },
    Nats(Box<Nats>),
}

/// NATS: the consumers reach the servers through `proxies` (one per server), which the run
/// cuts once; on servers of the run's own, the run also kills one and starts it again.
pub struct Nats {
    transport: NatsTransport,
    js: JetStream,
    proxies: Vec<Proxy>,
    servers: Servers,
    /// How many servers hold each stream.
    replicas: usize,
}

/// Where a NATS run's servers come from.
enum Servers {
    /// The test server, shared with other tests.
    Shared,
    /// A server of the run's own.
    Node(NatsNode),
    /// A JetStream cluster of the run's own.
    Cluster(NatsCluster),
}

impl Bus {
    /// The bus of the broker `url`'s scheme names, from idem's table of brokers
    /// ([`idem::transport::Broker::of_url`]); RabbitMQ's queues classic.
    pub async fn of_url(url: &str) -> Self {
        match idem::transport::Broker::of_url(url) {
            Ok(idem::transport::Broker::RabbitMq) => Self::rabbit(url, QueueType::Classic).await,
            Ok(idem::transport::Broker::Nats) => {
                Self::nats_at(url.to_owned(), Servers::Shared).await
            }
            Ok(other) => panic!("no test bus for {other:?}"),
            Err(e) => panic!("{e}"),
        }
    }

    pub async fn rabbit(urls: &str, queue_type: QueueType) -> Self {
        Self::Rabbit {
            urls: urls.to_owned(),
            queue_type,
            publisher: Box::new(broker::publisher_on(urls).await),
        }
    }

    /// NATS: the test server ([`nats_url`]).
    pub async fn nats() -> Self {
        Self::nats_at(nats_url(), Servers::Shared).await
    }

    /// NATS: a server of the run's own, which [`Bus::restart_server`] kills and starts again
    /// (without `nats-server` on the PATH the test fails; only with the opt-out of
    /// [`super::own_servers`] does it run on the test server, never restarted).
    pub async fn nats_of_its_own() -> Self {
        match NatsNode::start().await {
            Some(node) => Self::nats_at(node.url(), Servers::Node(node)).await,
            None => Self::nats().await,
        }
    }

    /// NATS: a JetStream cluster of the run's own, three servers holding every stream, where
    /// [`Bus::restart_server`] kills the server leading the orders queue's stream (without
    /// `nats-server` on the PATH the test fails; with the opt-out of [`super::own_servers`],
    /// `None`).
    pub async fn nats_cluster_of_its_own() -> Option<Self> {
        let cluster = NatsCluster::start().await?;
        Some(Self::nats_at(cluster.urls(), Servers::Cluster(cluster)).await)
    }

    async fn nats_at(urls: String, servers: Servers) -> Self {
        let js = match &servers {
            Servers::Shared => jetstream_or_fail().await,
            _ => {
                let servers: Vec<&str> = urls.split(',').collect();
                jetstream::new(async_nats::connect(servers.as_slice()).await.unwrap())
            }
        };
        let replicas = match &servers {
            Servers::Cluster(_) => 3,
            _ => 1,
        };
        let mut proxies = Vec::new();
        for url in urls.split(',') {
            let address = url
                .rsplit('@')
                .next()
                .unwrap_or_default()
                .trim_start_matches("nats://")
                .to_owned();
            proxies.push(Proxy::start(&address).await);
        }
        Self::Nats(Box::new(Nats {
            transport: NatsTransport::new(NatsConfig::new(urls).replicas(replicas)),
            js,
            proxies,
            servers,
            replicas,
        }))
    }

    /// Whether the run has servers of its own, one of which [`Bus::restart_server`] kills.
    pub fn can_restart(&self) -> bool {
        matches!(self, Self::Nats(nats) if !matches!(nats.servers, Servers::Shared))
    }

    /// Kills a server with SIGKILL and starts it again, when the run has servers of its own:
    /// its only one, or the one leading `queue`'s stream in a cluster, started again once
    /// another leads it. Whether it did.
    pub async fn restart_server(&self, queue: &str) -> bool {
        let Self::Nats(nats) = self else {
            return false;
        };
        match &nats.servers {
            Servers::Node(node) => {
                node.restart().await;
                true
            }
            Servers::Cluster(cluster) => {
                let name = stream(queue);
                let Some(leader) = NatsCluster::leader(&nats.js, &name).await else {
                    return false;
                };
                cluster.kill(leader);
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    match NatsCluster::leader(&nats.js, &name).await {
                        Some(now) if now != leader => break,
                        _ => assert!(
                            std::time::Instant::now() < deadline,
                            "no other server leads `{name}` 60 s after its leader was killed"
                        ),
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                eprintln!("killed server {leader}, which led `{name}`; another leads it now");
                cluster.start_again(leader).await;
                true
            }
            Servers::Shared => false,
        }
    }

    /// NATS: how many servers hold each stream of `queues` (work, retry and dead letters), as
    /// the server says; none on RabbitMQ.
    pub async fn stream_replicas(&self, queues: &[&str]) -> Vec<(String, usize)> {
        let Self::Nats(nats) = self else {
            return Vec::new();
        };
        let streams: Vec<String> = queues
            .iter()
            .flat_map(|queue| {
                let base = stream(queue);
                [base.clone(), format!("{base}_RETRY"), format!("{base}_DLQ")]
            })
            .collect();
        nats.replicas_of(&streams).await
    }

    /// NATS: how many servers hold each stream of the run.
    pub fn replicas(&self) -> usize {
        match self {
            Self::Nats(nats) => nats.replicas,
            Self::Rabbit { .. } => 1,
        }
    }

    /// The queue type, for the report.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Rabbit {
                queue_type: QueueType::Quorum,
                ..
            } => "quorum queues",
            Self::Rabbit { .. } => "classic queues",
            Self::Nats(nats) if nats.replicas > 1 => "a JetStream cluster",
            Self::Nats(_) => "NATS JetStream",
        }
    }

    /// Whether the broker is the machine's own RabbitMQ (the whereabouts report reads it).
    pub fn on_machine_rabbitmq(&self) -> bool {
        matches!(self, Self::Rabbit { urls, .. } if *urls == broker::amqp_url())
    }

    /// Whether the run can take the consumers' connections away (not on a cluster of its own).
    pub fn can_close(&self) -> bool {
        self.on_machine_rabbitmq() || matches!(self, Self::Nats(_))
    }

    /// `builder` with a transport to this broker.
    pub fn transport(&self, builder: RuntimeBuilder) -> RuntimeBuilder {
        match self {
            Self::Rabbit {
                urls, queue_type, ..
            } => builder.transport(RabbitTransport::new(
                RabbitConfig::new(urls.as_str()).queue_type(*queue_type),
            )),
            Self::Nats(nats) => builder.transport(nats.transport.clone()),
        }
    }

    /// A publisher of [`idem::Outgoing`] messages to this broker, as the outbox's relay
    /// publishes them (an ordered handler's source routes a key to its partition).
    pub fn outbound(&self) -> std::sync::Arc<dyn idem::transport::Outbound> {
        match self {
            Self::Rabbit {
                urls, queue_type, ..
            } => RabbitTransport::new(RabbitConfig::new(urls.as_str()).queue_type(*queue_type))
                .outbound()
                .unwrap(),
            Self::Nats(nats) => nats.transport.outbound().unwrap(),
        }
    }

    /// Declares `specs` as a runtime with these queues does.
    pub async fn declare_specs(&self, specs: &[QueueSpec]) {
        match self {
            Self::Rabbit {
                urls, queue_type, ..
            } => {
                let config = RabbitConfig::new(urls.as_str()).queue_type(*queue_type);
                RabbitTransport::new(config).declare(specs).await.unwrap();
            }
            Self::Nats(nats) => nats.transport.declare(specs).await.unwrap(),
        }
    }

    /// Declares the orders queue as its consumers do.
    pub async fn declare(&self, queue: &str) {
        match self {
            Self::Rabbit {
                urls, queue_type, ..
            } => broker::declare_orders_queue_on(urls, queue, *queue_type).await,
            Self::Nats(nats) => {
                let mut spec = QueueSpec::new(queue, "orders");
                spec.retry_delays = RetryPolicy::default().delays();
                nats.transport.declare(&[spec]).await.unwrap();
            }
        }
    }

    /// Publishes copy `copy` of `message` to `queue` (confirmed by [`Bus::confirm`] on
    /// RabbitMQ, at once on NATS, each copy with its own JetStream id).
    pub async fn publish(&self, queue: &str, message: &Envelope, copy: u64) {
        match self {
            Self::Rabbit { publisher, .. } => {
                publisher.publish_unconfirmed(queue, message).await.unwrap();
            }
            Self::Nats(nats) => {
                let id = message.message_id.clone().unwrap_or_default();
                let duplicate = nats
                    .transport
                    .publish(queue, message, Some(&format!("{id}#{copy}")))
                    .await
                    .unwrap();
                assert!(!duplicate, "JetStream dropped a copy");
            }
        }
    }

    pub async fn confirm(&self) {
        if let Self::Rabbit { publisher, .. } = self {
            publisher.wait_for_confirms().await.unwrap();
        }
    }

    /// The environment that points a consumer at this broker.
    pub fn point(&self, command: &mut Command) {
        match self {
            Self::Rabbit {
                urls, queue_type, ..
            } => {
                let queue_type = match queue_type {
                    QueueType::Quorum => "quorum",
                    _ => "classic",
                };
                command
                    .env("AMQP_URL", urls)
                    .env("ORDERS_QUEUE_TYPE", queue_type)
                    .env_remove("NATS_URL");
            }
            Self::Nats(nats) => {
                let urls: Vec<String> = nats
                    .proxies
                    .iter()
                    .map(|proxy| format!("nats://127.0.0.1:{}", proxy.port()))
                    .collect();
                command
                    .env("NATS_URL", urls.join(","))
                    .env("ORDERS_NATS_REPLICAS", nats.replicas.to_string());
            }
        }
    }

    /// How many dead letters `queue` has; a dead-letter queue or stream that does not exist
    /// fails the test.
    pub async fn dead(&self, queue: &str) -> usize {
        match self {
            Self::Rabbit { urls, .. } => broker::count_on(urls, &idem::rabbitmq::dlq(queue)).await,
            Self::Nats(nats) => nats.messages(&dlq_stream(queue)).await,
        }
    }

    /// The dead letters of `queue` (RabbitMQ: taken out of the DLQ).
    pub async fn dead_letters(&self, queue: &str) -> Vec<Letter> {
        match self {
            Self::Rabbit { urls, .. } => broker::drain_on(urls, &idem::rabbitmq::dlq(queue))
                .await
                .into_iter()
                .map(|got| Letter {
                    message_id: got.message_id(),
                    reason: got.header(idem::rabbitmq::REASON_HEADER),
                    body: got.body,
                    copy: None,
                })
                .collect(),
            Self::Nats(nats) => {
                let name = dlq_stream(queue);
                let mut stream = match nats.js.get_stream(&name).await {
                    Ok(stream) => stream,
                    Err(e) => panic!("reading the dead-letter stream `{name}`: {e}"),
                };
                let last = match stream.info().await {
                    Ok(info) => info.state.last_sequence,
                    Err(e) => panic!("reading the dead-letter stream `{name}`: {e}"),
                };
                let mut letters = Vec::new();
                for sequence in 1..=last {
                    if let Ok(message) = stream.get_raw_message(sequence).await {
                        let header =
                            |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
                        letters.push(Letter {
                            message_id: header("Idem-Message-Id").or_else(|| header("Nats-Msg-Id")),
                            reason: header(idem::nats::REASON_HEADER),
                            body: message.payload.to_vec(),
                            copy: Some(format!(
                                "{} stored {} as {sequence}",
                                header("Nats-Msg-Id").unwrap_or_default(),
                                message.time
                            )),
                        });
                    }
                }
                letters
            }
        }
    }

    /// NATS: the duplicate window of `queue`'s dead-letter stream, after setting it to `set`
    /// when given.
    pub async fn dead_letter_window(&self, queue: &str, set: Option<Duration>) -> Duration {
        let Self::Nats(nats) = self else {
            panic!("a dead-letter stream's duplicate window is JetStream's");
        };
        let mut stream = nats.js.get_stream(dlq_stream(queue)).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        if let Some(window) = set {
            config.duplicate_window = window;
            config = nats.js.update_stream(config).await.unwrap().config;
        }
        config.duplicate_window
    }

    /// Whether `queue`'s dead-letter queue (or stream) exists: the consumers declared it.
    pub async fn declared(&self, queue: &str) -> bool {
        match self {
            Self::Rabbit { urls, .. } => broker::try_count_on(urls, &idem::rabbitmq::dlq(queue))
                .await
                .is_ok(),
            Self::Nats(nats) => nats.js.get_stream(dlq_stream(queue)).await.is_ok(),
        }
    }

    /// How many messages `queues` and their retry queues (the default policy's) hold: on
    /// RabbitMQ those ready (unacknowledged ones are counted once their consumer is gone); on
    /// NATS those their consumers have still to deliver or have delivered unacknowledged. (A
    /// work-queue stream removes a message at its ack, but a server killed with SIGKILL can
    /// come back with messages its consumer had acknowledged: below the consumer's ack floor,
    /// they are never delivered again, and [`Bus::describe`] shows them.) A queue that does
    /// not exist fails the test.
    pub async fn left(&self, queues: &[&str]) -> usize {
        let delays = RetryPolicy::default().delays();
        let mut left = 0;
        for queue in queues {
            match self {
                Self::Rabbit { urls, .. } => {
                    left += broker::count_on(urls, queue).await;
                    for delay in &delays {
                        left += broker::count_on(urls, &idem::rabbitmq::retry_queue(queue, *delay))
                            .await;
                    }
                }
                Self::Nats(nats) => {
                    let stream = stream(queue);
                    left += nats.owed(&stream).await;
                    left += nats.owed(&format!("{stream}_RETRY")).await;
                }
            }
        }
        left
    }

    /// What holds the messages [`Bus::left`] counts, for a failure's message: on NATS each
    /// stream's state and its consumers' positions.
    pub async fn describe(&self, queues: &[&str]) -> String {
        let Self::Nats(nats) = self else {
            return String::new();
        };
        let mut out = String::new();
        for queue in queues {
            let base = stream(queue);
            for name in [base.clone(), format!("{base}_RETRY")] {
                let Ok(mut s) = nats.js.get_stream(&name).await else {
                    out.push_str(&format!("{name}: gone\n"));
                    continue;
                };
                if let Ok(info) = s.info().await {
                    out.push_str(&format!(
                        "{name}: {} messages, sequences {}..={}\n",
                        info.state.messages, info.state.first_sequence, info.state.last_sequence
                    ));
                }
                let names: Vec<String> = {
                    use futures_util::TryStreamExt;
                    s.consumer_names().try_collect().await.unwrap_or_default()
                };
                for consumer in names {
                    let info = s
                        .consumer_info(&consumer)
                        .await
                        .map(|i| {
                            format!(
                                "pending {}, ack pending {}, delivered up to {}, ack floor {}, redelivered {}",
                                i.num_pending,
                                i.num_ack_pending,
                                i.delivered.stream_sequence,
                                i.ack_floor.stream_sequence,
                                i.num_redelivered
                            )
                        })
                        .unwrap_or_else(|e| e.to_string());
                    out.push_str(&format!("  consumer {consumer}: {info}\n"));
                }
            }
        }
        out
    }

    /// Takes the consumers' connections away: RabbitMQ closes those of `queue`; the NATS
    /// proxy drops every connection for two seconds. Whether any was closed.
    pub async fn close_connections(&self, queue: &str) -> bool {
        match self {
            Self::Rabbit { .. } => broker::close_connections(queue) > 0,
            Self::Nats(nats) => {
                let broken: usize = nats.proxies.iter().map(Proxy::cut).sum();
                tokio::time::sleep(Duration::from_secs(2)).await;
                for proxy in &nats.proxies {
                    proxy.restore();
                }
                broken > 0
            }
        }
    }

    /// Deletes what `queue` left on the broker.
    pub async fn delete(&self, queue: &str) {
        self.delete_with(queue, &RetryPolicy::default().delays())
            .await;
    }

    /// Deletes an ordered handler's source (on RabbitMQ its exchange; on NATS the partition
    /// count the server records: its partitions are queues, deleted as such).
    pub async fn delete_source(&self, source: &str) {
        match self {
            Self::Rabbit { urls, .. } => broker::delete_on(urls, &[], &[source.to_owned()]).await,
            Self::Nats(nats) => {
                nats.transport.delete_source(source).await.unwrap();
            }
        }
    }

    /// Deletes what `queue` left on the broker, its retry queues those of `delays`.
    pub async fn delete_with(&self, queue: &str, delays: &[Duration]) {
        match self {
            Self::Rabbit { urls, .. } => {
                broker::delete_topology_on(urls, queue, delays).await;
            }
            Self::Nats(nats) => {
                nats.transport.delete_queue(queue).await.unwrap();
            }
        }
    }
}

impl Nats {
    /// What the consumers of the stream `name` have still to deliver or to see acknowledged;
    /// a stream without a consumer, or one that does not exist, fails the test. (Asked again
    /// for up to 30 s: while a cluster that lost a server elects leaders and answers
    /// "unavailable", and while a consumer is still being declared.)
    async fn owed(&self, name: &str) -> usize {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match self.try_owed(name).await {
                Ok(owed) => return owed,
                Err(e) if std::time::Instant::now() > deadline => panic!("{e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    async fn try_owed(&self, name: &str) -> Result<usize, String> {
        use futures_util::TryStreamExt;
        let stream = self
            .js
            .get_stream(name)
            .await
            .map_err(|e| format!("reading the stream `{name}`: {e}"))?;
        let consumers: Vec<String> = stream
            .consumer_names()
            .try_collect()
            .await
            .map_err(|e| format!("listing the consumers of `{name}`: {e}"))?;
        if consumers.is_empty() {
            return Err(format!("the stream `{name}` has no consumer"));
        }
        let mut owed = 0;
        for consumer in consumers {
            let info = stream
                .consumer_info(&consumer)
                .await
                .map_err(|e| format!("reading the consumer `{consumer}` of `{name}`: {e}"))?;
            owed += info.num_pending as usize + info.num_ack_pending;
        }
        Ok(owed)
    }

    /// The number of servers holding each of `streams`, as the server says.
    async fn replicas_of(&self, streams: &[String]) -> Vec<(String, usize)> {
        let mut found = Vec::new();
        for name in streams {
            let mut stream = self.js.get_stream(name).await.unwrap();
            let info = stream.info().await.unwrap();
            found.push((name.clone(), info.config.num_replicas));
        }
        found
    }

    /// How many messages the stream `name` holds (on a work-queue stream, those not yet
    /// acknowledged); a stream that does not exist fails the test.
    async fn messages(&self, name: &str) -> usize {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let info = match self.js.get_stream(name).await {
                Ok(mut stream) => stream
                    .info()
                    .await
                    .map(|i| i.state.messages)
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match info {
                Ok(n) => return usize::try_from(n).unwrap_or(usize::MAX),
                Err(e) if std::time::Instant::now() > deadline => {
                    panic!("reading the stream `{name}`: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// The stream of `queue` on NATS.
fn stream(queue: &str) -> String {
    format!("IDEM_{}", queue.replace('.', "_"))
}

/// The dead-letter stream of `queue` on NATS.
fn dlq_stream(queue: &str) -> String {
    format!("{}_DLQ", stream(queue))
}
