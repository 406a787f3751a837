//! Where a chaos run's unshipped orders are (`tests/chaos.rs`), for the message of a run that
//! does not converge.

/// Where the orders stored but not shipped are (their rows in the inbox tables and the
/// outbox), the dead letters of orders and shipments but for the malformed ones, and (on the
/// machine's broker) the run's queues with their ready and unacked counts: so that a run that
/// does not converge says where its missing orders and shipments went.
pub async fn report(pool: &sqlx::PgPool, queue: &str, on_machine_broker: bool) -> String {
    let missing: Vec<String> = sqlx::query_scalar(
        "SELECT o.order_id FROM orders o LEFT JOIN shipments s USING (order_id)
         WHERE o.order_id LIKE $1 AND s.order_id IS NULL ORDER BY o.order_id LIMIT 5",
    )
    .bind(format!("{queue}-%"))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let mut report = format!("orders not shipped (up to 5): {missing:?}\n");
    for order in &missing {
        // The order's rows carry its id; the shipping rows, its event's (the first message
        // the `orders` consumer staged for it).
        let event = idem::outbox::outbox_message_id("orders", order, 0);
        let keys = [order.as_str(), event.as_str()];
        for (table, sql) in [
            (
                "inbox",
                "SELECT consumer || ' ' || key || ' ' || status || ' attempts ' || attempts
                        || ' owner ' || coalesce(owner, '-') || ' outcome ' || coalesce(outcome, '-')
                 FROM idem_inbox WHERE key = ANY($1)",
            ),
            (
                "deliveries",
                "SELECT consumer || ' ' || key || ' ' || deliveries
                 FROM idem_inbox_deliveries WHERE key = ANY($1)",
            ),
            (
                "dead letters",
                "SELECT consumer || ' ' || key || ' ' || queue || ' ' || reason || ': ' || detail
                 FROM idem_inbox_dead_letters WHERE key = ANY($1)",
            ),
            (
                "outbox",
                "SELECT key || ' ' || coalesce(message_id, '-') FROM idem_outbox WHERE key = ANY($1) OR message_id = ANY($1)",
            ),
        ] {
            let rows: Result<Vec<String>, _> = sqlx::query_scalar(sql)
                .bind(&keys[..])
                .fetch_all(pool)
                .await;
            report.push_str(&format!("  {order} {table}: {rows:?}\n"));
        }
    }
    let dead: Result<Vec<String>, _> = sqlx::query_scalar(
        "SELECT consumer || ' ' || key || ' ' || coalesce(message_id, '-') || ' attempts '
                || attempts || ' ' || reason || ': ' || detail
         FROM idem_inbox_dead_letters WHERE queue IN ($1, $2) AND reason <> 'decode'",
    )
    .bind(queue)
    .bind(format!("{queue}.billed"))
    .fetch_all(pool)
    .await;
    report.push_str(&format!(
        "dead letters of {queue} and {queue}.billed, but for the malformed: {dead:?}\n"
    ));
    if on_machine_broker {
        let listed = super::rabbitmqctl()
            .args([
                "list_queues",
                "-q",
                "name",
                "messages_ready",
                "messages_unacknowledged",
                "consumers",
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        report.push_str("queues (name, ready, unacked, consumers):\n");
        for line in listed.lines().filter(|l| l.starts_with(queue)) {
            report.push_str(&format!("  {line}\n"));
        }
    }
    report
}
