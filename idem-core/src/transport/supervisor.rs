//! The life of one queue's consumer, the same on every broker ([`supervise`]): sessions one
//! after another until shutdown, a backoff between failed ones that starts over once a session
//! consumed for a while, and what operators see of it: whether the queue is consuming (health checks,
//! `idem_broker_connected`), each reconnection (`idem_reconnects_total`) and a warning
//! naming the cause. A transport writes only its [`Session`]: connect, declare, consume.

use super::contract::StopSignal;
use crate::future::BoxFuture;
use crate::telemetry;
use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

/// How long a session must have consumed for the backoff after it to start over.
const STEADY: Duration = Duration::from_secs(1);

/// How a session ended without a failure: the consumer stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Shutdown was asked for.
    Stopped,
    /// The runtime dropped the handler's mailbox.
    MailboxClosed,
}

/// One consumer session of a transport: connect, declare, consume until it ends.
pub trait Session: Send {
    /// Why a session was lost.
    type Lost: fmt::Display + Send;

    /// Runs one session. It calls [`Began::consuming`] once it consumes; it ends with
    /// [`Ended`] on shutdown, or with why it was lost, to be started again after a backoff.
    fn run<'a>(&'a mut self, began: &'a Began) -> BoxFuture<'a, Result<Ended, Self::Lost>>;

    /// After a lost session, before the backoff: deals with the cause where the transport can
    /// (RabbitMQ takes out a delivery its client cannot parse); `true` starts the next session
    /// at once. The default deals with nothing.
    fn recover<'a>(&'a mut self, lost: &'a Self::Lost) -> BoxFuture<'a, bool> {
        let _ = lost;
        Box::pin(std::future::ready(false))
    }
}

/// The queues whose consumers are consuming now, shared by a transport's consumers and read by
/// its `Transport::connected`.
#[derive(Debug, Clone, Default)]
pub struct Consuming(Arc<Mutex<HashSet<String>>>);

impl Consuming {
    /// Records whether `queue`'s consumer is consuming, and reports it as
    /// `idem_broker_connected`.
    pub fn set(&self, queue: &str, consuming: bool) {
        let mut queues = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match consuming {
            true => queues.insert(queue.to_owned()),
            false => queues.remove(queue),
        };
        telemetry::broker_connected(queue, consuming);
    }

    /// Whether `queue`'s consumer is consuming.
    pub fn contains(&self, queue: &str) -> bool {
        let queues = self.0.lock().unwrap_or_else(|e| e.into_inner());
        queues.contains(queue)
    }
}

/// Handed to each session: it says when the session consumes.
#[derive(Debug)]
pub struct Began {
    queue: String,
    consuming: Consuming,
    at: OnceLock<Instant>,
}

impl Began {
    /// The session consumes: the queue reads as connected. Once it has consumed for a second,
    /// the next failure's backoff starts from the shortest.
    pub fn consuming(&self) {
        let _ = self.at.set(Instant::now());
        self.consuming.set(&self.queue, true);
    }

    /// Whether the session consumed for at least `long`.
    fn consumed_for(&self, long: Duration) -> bool {
        self.at.get().is_some_and(|at| at.elapsed() >= long)
    }
}

/// What [`supervise`] needs besides the session.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Supervision {
    /// The queue, for logs, metrics and health.
    pub queue: String,
    /// The broker's name, for logs (`RabbitMQ`, `NATS`).
    pub broker: &'static str,
    /// The first wait after a lost session.
    pub reconnect_min: Duration,
    /// The longest wait; each failure in a row doubles the wait up to it.
    pub reconnect_max: Duration,
    /// Where the queue's state is recorded.
    pub consuming: Consuming,
    /// Raised at shutdown.
    pub stop: StopSignal,
}

impl Supervision {
    /// The supervision of `queue` on `broker`, waiting `reconnect_min` after a first failure
    /// and at most `reconnect_max`.
    pub fn new(
        queue: impl Into<String>,
        broker: &'static str,
        (reconnect_min, reconnect_max): (Duration, Duration),
        consuming: Consuming,
        stop: StopSignal,
    ) -> Self {
        Self {
            queue: queue.into(),
            broker,
            reconnect_min,
            reconnect_max,
            consuming,
            stop,
        }
    }
}

/// Runs `session` again and again until it ends ([`Ended`]) or shutdown is raised: after a lost
/// session the queue reads as not consuming and the loss is counted; unless the session
/// recovers from it ([`Session::recover`]), it is logged and the next session starts after a
/// backoff (doubling from `reconnect_min` to `reconnect_max`, and from `reconnect_min` again
/// after a session that consumed for a second or longer). Shutdown ends a backoff at once.
pub async fn supervise<S: Session>(mut session: S, supervision: Supervision) {
    let Supervision {
        queue,
        broker,
        reconnect_min,
        reconnect_max,
        consuming,
        mut stop,
    } = supervision;
    let mut backoff = reconnect_min;
    while !*stop.borrow() {
        let began = Began {
            queue: queue.clone(),
            consuming: consuming.clone(),
            at: OnceLock::new(),
        };
        let ended = session.run(&began).await;
        consuming.set(&queue, false);
        // A session that failed soon after it began consuming (a message it cannot take, a
        // stream gone again) keeps backing off.
        if began.consumed_for(STEADY) {
            backoff = reconnect_min;
        }
        let lost = match ended {
            Ok(Ended::Stopped | Ended::MailboxClosed) => return,
            Err(lost) => lost,
        };
        telemetry::reconnect(&queue);
        if session.recover(&lost).await {
            backoff = reconnect_min;
            continue;
        }
        tracing::warn!(queue, broker, error = %lost, retry_in = ?backoff, "consumer lost; consuming again");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        backoff = (backoff * 2).min(reconnect_max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use tokio::sync::watch;
    use tokio::time::Instant;

    /// A session that plays a script: each run consumes for so many seconds or not at all, and
    /// ends as told; a loss named `unparsable` is recovered.
    struct Scripted {
        script: VecDeque<(Option<u64>, Result<Ended, &'static str>)>,
        started: Vec<Instant>,
        recovered: Vec<&'static str>,
    }

    impl Session for &mut Scripted {
        type Lost = &'static str;

        fn run<'a>(&'a mut self, began: &'a Began) -> BoxFuture<'a, Result<Ended, &'static str>> {
            self.started.push(Instant::now());
            let (consumed, end) = self
                .script
                .pop_front()
                .unwrap_or((None, Ok(Ended::Stopped)));
            Box::pin(async move {
                if let Some(seconds) = consumed {
                    began.consuming();
                    tokio::time::sleep(Duration::from_secs(seconds)).await;
                }
                end
            })
        }

        fn recover<'a>(&'a mut self, lost: &'a &'static str) -> BoxFuture<'a, bool> {
            self.recovered.push(lost);
            Box::pin(std::future::ready(*lost == "unparsable"))
        }
    }

    fn scripted(script: Vec<(Option<u64>, Result<Ended, &'static str>)>) -> Scripted {
        Scripted {
            script: script.into(),
            started: Vec::new(),
            recovered: Vec::new(),
        }
    }

    fn supervision(consuming: &Consuming, stop: StopSignal) -> Supervision {
        let waits = (Duration::from_secs(1), Duration::from_secs(4));
        Supervision::new("q", "test", waits, consuming.clone(), stop)
    }

    /// The gaps between session starts, in whole seconds.
    fn gaps(started: &[Instant]) -> Vec<u64> {
        started
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64().round() as u64)
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_doubles_up_to_its_most_and_starts_over_after_a_steady_session() {
        let (_tx, stop) = watch::channel(false);
        let consuming = Consuming::default();
        let mut session = scripted(vec![
            (None, Err("refused")),
            (None, Err("refused")),
            (None, Err("refused")),
            (None, Err("refused")),
            // Lost as soon as it consumed: the backoff goes on growing.
            (Some(0), Err("cut")),
            // Consumed for a second: it starts over.
            (Some(1), Err("cut")),
            (None, Err("refused")),
            (Some(0), Ok(Ended::MailboxClosed)),
        ]);
        supervise(&mut session, supervision(&consuming, stop)).await;
        assert_eq!(gaps(&session.started), [1, 2, 4, 4, 4, 2, 2]);
        assert!(
            !consuming.contains("q"),
            "a session that ended is not consuming"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_recovered_loss_starts_again_at_once_and_shutdown_ends_a_backoff() {
        let (tx, stop) = watch::channel(false);
        let consuming = Consuming::default();
        let mut session = scripted(vec![(Some(0), Err("unparsable")), (Some(0), Err("cut"))]);
        let began = Instant::now();
        let stopper = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            tx.send(true).unwrap();
        };
        tokio::join!(
            supervise(&mut session, supervision(&consuming, stop)),
            stopper
        );
        assert!(
            began.elapsed() < Duration::from_millis(100),
            "{:?}",
            began.elapsed()
        );
        assert_eq!(gaps(&session.started), [0]);
        assert_eq!(session.recovered, ["unparsable", "cut"]);
    }
}
