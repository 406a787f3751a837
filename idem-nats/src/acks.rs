//! [`Acks`]: one queue's acks, sent plainly and confirmed in bulk. JetStream takes the acks of
//! a consumer into one queue in the order they arrive and answers a confirmed ack only once it
//! has taken it; so the confirm of the last ack sent confirms every ack sent before it on the
//! same connection. A handler's settlement therefore costs one publish, and a confirm runs in
//! the background, at most one at a time per queue and a few a second, for everything acked
//! since the last one.
//! The transport's `close` waits for the last confirm ([`Acks::confirmed`]), so that a
//! shutdown ends with its settlements known.
//!
//! The acks sent on a connection the client has since replaced may have been lost with it:
//! they are sent again on the new one before its confirm. An ack lost for good (the confirms
//! kept failing for a while) brings its delivery back after the ack wait, and the inbox makes
//! the run a duplicate.

use async_nats::Subject;
use bytes::Bytes;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a confirm waits for more acks to cover, unless a close asks for it now: the
/// confirm answers only for a shutdown, so a few a second are enough.
const LINGER: Duration = Duration::from_millis(50);

/// How long the confirms of a queue keep being tried while they fail (the connection is down)
/// before the acks sent so far are left to redelivery.
const PATIENCE: Duration = Duration::from_secs(10);

/// One queue's acks (see the module).
#[derive(Debug, Default)]
pub(crate) struct Acks {
    state: Mutex<State>,
    /// Woken when every ack sent is confirmed (or left to redelivery).
    settled: Notify,
    /// Wakes a confirm that lingers: a close waits for it.
    hurry: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The acks sent and not confirmed yet, in the order sent, each with the connection it
    /// went out on (the client's count of connects then).
    unconfirmed: Vec<(Subject, u64)>,
    /// Whether a confirm task runs.
    confirming: bool,
}

/// The client's count of connects: which connection it is on now.
fn connection(client: &async_nats::Client) -> u64 {
    client
        .statistics()
        .connects
        .load(std::sync::atomic::Ordering::Relaxed)
}

impl Acks {
    /// Sends the ack of the delivery whose reply subject is `reply`, without waiting for an
    /// answer, and has it confirmed with the others.
    pub(crate) async fn ack(
        self: &Arc<Self>,
        client: &async_nats::Client,
        reply: &Subject,
    ) -> Result<(), async_nats::Error> {
        let on = connection(client);
        client
            .publish(reply.clone(), Bytes::from_static(b"+ACK"))
            .await?;
        let start = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.unconfirmed.push((reply.clone(), on));
            !std::mem::replace(&mut state.confirming, true)
        };
        if start {
            tokio::spawn(self.clone().confirm(client.clone()));
        }
        Ok(())
    }

    /// Confirms the last ack sent until every ack sent is confirmed. Acks sent on a connection
    /// the client has since replaced may have been lost with it: they are sent again on the
    /// current one before its confirm, which then covers them too.
    async fn confirm(self: Arc<Self>, client: async_nats::Client) {
        let mut failing_since = None;
        let mut pause = Duration::from_millis(50);
        loop {
            tokio::select! {
                () = tokio::time::sleep(LINGER) => {}
                () = self.hurry.notified() => {}
            }
            let on = connection(&client);
            let (covered, again, last) = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let Some((last, _)) = state.unconfirmed.last().cloned() else {
                    state.confirming = false;
                    drop(state);
                    self.settled.notify_waiters();
                    return;
                };
                let mut again = Vec::new();
                for (reply, sent_on) in &mut state.unconfirmed {
                    if *sent_on != on {
                        again.push(reply.clone());
                        *sent_on = on;
                    }
                }
                (state.unconfirmed.len(), again, last)
            };
            for reply in again {
                let _ = client.publish(reply, Bytes::from_static(b"+ACK")).await;
            }
            match confirm_ack(&client, Some(&last)).await {
                // Confirmed on the connection they went out on: every ack up to `last` is in.
                Ok(()) if connection(&client) == on => {}
                // The connection changed under the confirm: the next round sends them again.
                Ok(()) => continue,
                Err(e) => {
                    let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() < PATIENCE {
                        tracing::debug!(error = %e, "acks were not confirmed; asking again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                        continue;
                    }
                    tracing::debug!(error = %e, "acks not confirmed are left to redelivery");
                }
            }
            failing_since = None;
            pause = Duration::from_millis(50);
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.unconfirmed.drain(..covered);
        }
    }

    /// Resolves once every ack sent so far is confirmed (or left to redelivery).
    pub(crate) async fn confirmed(&self) {
        self.hurry.notify_one();
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            {
                let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if state.unconfirmed.is_empty() {
                    return;
                }
            }
            settled.await;
        }
    }
}

/// Acks the delivery whose reply subject is `reply`, once, and waits for JetStream's confirm.
/// A request on the client's shared reply subscription: async-nats's own `double_ack`
/// subscribes and unsubscribes an inbox for every ack, three protocol messages instead of one.
pub(crate) async fn confirm_ack(
    client: &async_nats::Client,
    reply: Option<&Subject>,
) -> Result<(), async_nats::Error> {
    let reply = reply.ok_or("a delivery without a reply subject cannot be acked")?;
    let request = async_nats::Request::new()
        .payload(Bytes::from_static(b"+ACK"))
        .timeout(Some(ACK_TIMEOUT));
    client.send_request(reply.clone(), request).await?;
    Ok(())
}

/// How long one confirmed ack waits for JetStream's answer.
pub(crate) const ACK_TIMEOUT: Duration = Duration::from_secs(5);
