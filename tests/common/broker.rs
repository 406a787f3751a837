//! RabbitMQ helpers for the tests: the broker URL, publishing, reading a queue, closing
//! connections from the broker's side.

use idem::rabbitmq::{Publisher, RabbitConfig};
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::time::Duration;

/// The broker the tests use: the one [`with_the_plugin`] chose for this test binary, else
/// `AMQP_URL`, else the development machine's.
pub fn amqp_url() -> String {
    match WITH_THE_PLUGIN.get() {
        Some(chosen) => chosen.url.clone(),
        None => machine_url(),
    }
}

/// `AMQP_URL`, or the development machine's broker.
fn machine_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A broker with RabbitMQ's consistent-hash plugin, and whether it is node 1 of the cluster.
pub struct WithThePlugin {
    pub url: String,
    /// Node 1 of `scripts/rabbitmq-cluster` (controlled through the script), not the machine's.
    pub cluster_node: bool,
}

static WITH_THE_PLUGIN: tokio::sync::OnceCell<WithThePlugin> = tokio::sync::OnceCell::const_new();

/// For the test binaries whose ordered handlers route through the consistent-hash exchange:
/// from the first call on, this binary's [`amqp_url`] and [`super::rabbitmqctl`] are a broker
/// with the plugin. That is the machine's when it has the plugin enabled; else node 1 of the
/// 3-node cluster of `scripts/rabbitmq-cluster` (started if it is down), whose nodes enable it,
/// so that the suite passes on a RabbitMQ as its package installs it. Each test of such a
/// binary calls it first.
pub async fn with_the_plugin() -> &'static WithThePlugin {
    WITH_THE_PLUGIN
        .get_or_init(|| async {
            let machine = machine_url();
            let config = RabbitConfig::new(&machine);
            if idem::rabbitmq::consistent_hash_available(&config).await.unwrap_or(false) {
                return WithThePlugin {
                    url: machine,
                    cluster_node: false,
                };
            }
            assert!(
                super::own_servers::can_start("rabbitmq-server", "the RabbitMQ node with the consistent-hash plugin"),
                "the machine's RabbitMQ has no consistent-hash plugin: enable it (`rabbitmq-plugins enable rabbitmq_consistent_hash_exchange`) or put rabbitmq-server on the PATH"
            );
            let urls = tokio::task::spawn_blocking(|| super::cluster::script_output(&["start"]))
                .await
                .unwrap();
            let url = urls.trim().split(',').next().unwrap().to_owned();
            WithThePlugin {
                url,
                cluster_node: true,
            }
        })
        .await
}

/// Whether [`with_the_plugin`] chose node 1 of the cluster for this binary.
pub fn on_the_cluster_node() -> bool {
    WITH_THE_PLUGIN
        .get()
        .is_some_and(|chosen| chosen.cluster_node)
}

/// A confirmed publisher, or a failure saying how to start RabbitMQ.
pub async fn publisher() -> Publisher {
    publisher_on(&amqp_url()).await
}

/// A confirmed publisher to the broker(s) at `url`.
pub async fn publisher_on(url: &str) -> Publisher {
    Publisher::connect(&RabbitConfig::new(url)).await.unwrap_or_else(|e| {
        panic!("RabbitMQ is not reachable at {url}: {e}\nstart it (`docker compose up -d` starts one), or point AMQP_URL at one")
    })
}

/// Publishes `body` with `message_id` (if any) and extra properties.
pub async fn publish(publisher: &Publisher, queue: &str, message_id: Option<&str>, body: &[u8]) {
    let mut message = idem::Envelope::new(body).with_content_type("application/json");
    if let Some(id) = message_id {
        message = message.with_message_id(id);
    }
    publisher
        .publish("", queue, &message)
        .await
        .expect("confirmed publish");
}

/// A message read back from a queue.
#[derive(Debug)]
pub struct Got {
    pub properties: BasicProperties,
    pub body: Vec<u8>,
}

impl Got {
    /// A header as text (strings) or decimal (integers).
    pub fn header(&self, name: &str) -> Option<String> {
        use lapin::types::AMQPValue;
        let value = self
            .properties
            .headers()
            .as_ref()?
            .inner()
            .get(name)?
            .clone();
        Some(match value {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.to_string(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            AMQPValue::LongInt(n) => n.to_string(),
            other => format!("{other:?}"),
        })
    }

    /// The message id.
    pub fn message_id(&self) -> Option<String> {
        self.properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
    }
}

/// Closes a helper's connection, giving the broker a few seconds to confirm: a close that is
/// never confirmed must not hang the test (the broker drops the connection on its side).
pub async fn close(connection: Connection) {
    let closing = connection.close(200, ShortString::from("done"));
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), closing).await;
}

pub async fn connect() -> Connection {
    connect_to(&amqp_url()).await
}

/// A connection to the first broker of the comma-separated `urls` that takes one.
async fn connect_to(urls: &str) -> Connection {
    let mut failed = None;
    for url in urls.split(',') {
        match Connection::connect(url.trim(), ConnectionProperties::default()).await {
            Ok(connection) => return connection,
            Err(e) => failed = Some(e),
        }
    }
    panic!("connect to RabbitMQ at {urls}: {failed:?}")
}

/// Declares `queue` as the orders example declares it (consumer `orders`, the default retry
/// delays), so that nothing published before the example starts is dropped.
pub async fn declare_orders_queue(queue: &str) {
    declare_orders_queue_on(&amqp_url(), queue, idem::rabbitmq::QueueType::Classic).await;
}

/// [`declare_orders_queue`] on the broker(s) at `url`, of type `queue_type`.
pub async fn declare_orders_queue_on(
    url: &str,
    queue: &str,
    queue_type: idem::rabbitmq::QueueType,
) {
    use idem::transport::Transport;
    let mut spec = idem::transport::QueueSpec::default();
    spec.queue = queue.to_owned();
    spec.consumer = "orders".into();
    spec.retry_delays = idem::RetryPolicy::default().delays();
    let rabbit = idem::rabbitmq::RabbitConfig::new(url).queue_type(queue_type);
    idem::rabbitmq::RabbitTransport::new(rabbit)
        .declare(&[spec])
        .await
        .expect("declare the orders queue");
}

/// `host:port` of the broker at `AMQP_URL`.
pub fn amqp_address() -> String {
    let url = amqp_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    host.split('/').next().unwrap_or(host).to_owned()
}

/// Takes every message now in `queue`.
pub async fn drain(queue: &str) -> Vec<Got> {
    drain_on(&amqp_url(), queue).await
}

/// [`drain`] on the broker(s) at `url`.
pub async fn drain_on(url: &str, queue: &str) -> Vec<Got> {
    let connection = connect_to(url).await;
    let channel = connection.create_channel().await.expect("channel");
    let mut got = Vec::new();
    while let Some(message) = channel
        .basic_get(ShortString::from(queue), BasicGetOptions::default())
        .await
        .expect("basic.get")
    {
        let delivery = message.delivery;
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        got.push(Got {
            properties: delivery.properties,
            body: delivery.data,
        });
    }
    close(connection).await;
    got
}

/// Takes one message from `queue` and gives it back (`basic.nack` with requeue), as a consumer
/// that crashes on it would. Returns whether a message came within `deadline`.
pub async fn give_back(queue: &str, deadline: Duration) -> bool {
    use lapin::options::BasicNackOptions;
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let start = std::time::Instant::now();
    let mut given = false;
    while start.elapsed() < deadline {
        let got = channel
            .basic_get(ShortString::from(queue), BasicGetOptions::default())
            .await
            .expect("basic.get");
        if let Some(message) = got {
            message
                .delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .expect("nack");
            given = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    close(connection).await;
    given
}

/// Status partitions the orders example declares beside its queue, unless configured.
const EXAMPLE_STATUS_PARTITIONS: usize = 4;

/// Deletes `queue` and the queues idem declared beside it (with, when `queue` was the orders
/// example's, the example's status partitions and exchange).
pub async fn delete_topology(queue: &str, delays: &[Duration]) {
    delete_topology_on(&amqp_url(), queue, delays).await
}

/// Deletes `queues` and `exchanges` on the broker(s) at `urls`, each on a channel of its own
/// (a delete that fails closes its channel); one that is already gone is no error.
pub async fn delete_on(urls: &str, queues: &[String], exchanges: &[String]) {
    let connection = connect_to(urls).await;
    for name in exchanges {
        let channel = connection.create_channel().await.expect("channel");
        let options = lapin::options::ExchangeDeleteOptions::default();
        let _ = channel
            .exchange_delete(ShortString::from(name.as_str()), options)
            .await;
    }
    for name in queues {
        let channel = connection.create_channel().await.expect("channel");
        let _ = channel
            .queue_delete(
                ShortString::from(name.as_str()),
                QueueDeleteOptions::default(),
            )
            .await;
    }
    close(connection).await;
}

/// [`delete_topology`] on the broker(s) at `url`.
pub async fn delete_topology_on(url: &str, queue: &str, delays: &[Duration]) {
    let mut names = vec![queue.to_owned(), idem::rabbitmq::dlq(queue)];
    names.extend(
        delays
            .iter()
            .map(|d| idem::rabbitmq::retry_queue(queue, *d)),
    );
    let status = format!("{queue}.status");
    for index in 0..EXAMPLE_STATUS_PARTITIONS {
        let partition = idem::transport::Partition::queue_name(&status, index);
        names.push(idem::rabbitmq::dlq(&partition));
        names.push(partition);
    }
    delete_on(url, &names, &[status]).await;
}

/// Closes, from the broker's side (`rabbitmqctl close_connection`), every connection whose
/// client-provided name contains `name`. Returns how many it closed.
pub fn close_connections(name: &str) -> usize {
    let listed = super::rabbitmqctl()
        .args(["list_connections", "-q", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl");
    let text = String::from_utf8_lossy(&listed.stdout);
    let mut closed = 0;
    for line in text.lines().filter(|l| l.contains(name)) {
        let Some(pid) = line.split('\t').next() else {
            continue;
        };
        let status = super::rabbitmqctl()
            .args(["close_connection", pid, "closed by an idem test"])
            .status()
            .expect("rabbitmqctl close_connection");
        if status.success() {
            closed += 1;
        }
    }
    closed
}

/// How many messages are ready in `queue` (a passive declare; not counting unacked ones).
/// A queue that does not exist fails the test: it is not an empty one.
pub async fn count(queue: &str) -> usize {
    count_on(&amqp_url(), queue).await
}

/// [`count`] on the broker(s) at `url`.
pub async fn count_on(url: &str, queue: &str) -> usize {
    match try_count_on(url, queue).await {
        Ok(n) => n,
        Err(e) => panic!("counting the messages of `{queue}`: {e}"),
    }
}

/// [`count_on`], or the broker's refusal (the queue does not exist, say).
pub async fn try_count_on(url: &str, queue: &str) -> Result<usize, lapin::Error> {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let connection = connect_to(url).await;
    let channel = connection.create_channel().await.expect("channel");
    let declared = channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    close(connection).await;
    declared.map(|q| q.message_count() as usize)
}

/// Whether `queue` exists (a passive declare).
pub async fn exists(queue: &str) -> bool {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(ShortString::from(queue), passive, FieldTable::default())
        .await;
    close(connection).await;
    declared.is_ok()
}

/// How many deliveries of `queue` are unacknowledged, from the broker (`rabbitmqctl`). A
/// failed `rabbitmqctl`, or a queue it does not list, fails the test.
pub fn unacked(queue: &str) -> usize {
    let listed = super::rabbitmqctl()
        .args(["list_queues", "-q", "name", "messages_unacknowledged"])
        .output()
        .expect("rabbitmqctl");
    assert!(
        listed.status.success(),
        "`rabbitmqctl list_queues` failed: {}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let text = String::from_utf8_lossy(&listed.stdout);
    let found = text
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .find(|(name, _)| *name == queue);
    match found.map(|(_, n)| n.trim().parse()) {
        Some(Ok(n)) => n,
        Some(Err(e)) => panic!("`rabbitmqctl list_queues` gave `{queue}` an unreadable count: {e}"),
        None => panic!("`rabbitmqctl list_queues` does not list `{queue}`"),
    }
}

/// Deletes `exchange` (an ordered handler's, after its partition queues).
pub async fn delete_exchange(exchange: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    let _ = channel
        .exchange_delete(
            ShortString::from(exchange),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await;
    close(connection).await;
}

/// Declares a durable `direct` exchange named `exchange` (one in the way of an ordered handler).
pub async fn declare_direct_exchange(exchange: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.expect("channel");
    channel
        .exchange_declare(
            ShortString::from(exchange),
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("declare the exchange");
    close(connection).await;
}
