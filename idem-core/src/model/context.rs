//! What a handler may know about the delivery it is processing.

use super::envelope::{Envelope, HeaderValue};
use super::error::HandlerError;
use super::outgoing::{
    CAUSATION_HEADER, Outgoing, TRACEPARENT_HEADER, batch_message_id, outbox_message_id,
};
use crate::state::{self, State};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// The delivery a handler is processing, passed as an optional parameter after the payload
/// (`ctx: &idem::Context<'_>`), with the runtime's [`State`] and the outbox its store keeps.
#[derive(Debug)]
pub struct Context<'a> {
    envelope: &'a Envelope,
    consumer: &'a str,
    key: &'a str,
    state: &'a State,
    outbox: Option<&'a str>,
    /// The key staged rows are grouped under for their dispatch (a batch's first key).
    run: &'a str,
    /// A batch handler's context: the context of each of its messages.
    items: &'a [Context<'a>],
    /// Messages stamped by [`Context::outgoing`] so far: the next one's ordinal.
    staged: AtomicU32,
    /// The handler's transaction, as the store names it ([`Context::with_transaction`]).
    transaction: Option<usize>,
    /// The messages staged in the handler's own transaction, outside any savepoint, in order;
    /// `None` once one was staged elsewhere ([`Context::kept`]).
    kept: Mutex<Option<Vec<Outgoing>>>,
}

impl Clone for Context<'_> {
    fn clone(&self) -> Self {
        Self {
            envelope: self.envelope,
            consumer: self.consumer,
            key: self.key,
            state: self.state,
            outbox: self.outbox,
            run: self.run,
            items: self.items,
            staged: AtomicU32::new(self.staged()),
            transaction: self.transaction,
            kept: Mutex::new(self.kept.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        }
    }
}

impl<'a> Context<'a> {
    /// A context for `envelope`, processed by `consumer` under dedup key `key`. The runtime
    /// builds these; tests that call a handler directly can too.
    pub fn new(envelope: &'a Envelope, consumer: &'a str, key: &'a str) -> Self {
        Self {
            envelope,
            consumer,
            key,
            state: &state::EMPTY,
            outbox: None,
            run: key,
            items: &[],
            staged: AtomicU32::new(0),
            transaction: None,
            kept: Mutex::new(Some(Vec::new())),
        }
    }

    /// This context as run in the transaction the store names `transaction` (an identity
    /// that stays the same while the handler runs): messages staged in it, outside any
    /// savepoint, are kept for their dispatch ([`Context::keep_staged`]).
    pub fn with_transaction(self, transaction: Option<usize>) -> Self {
        Self {
            transaction,
            ..self
        }
    }

    /// Called by a store once it staged `messages` (stamped) in the transaction it names
    /// `transaction`, at savepoint depth `depth` (1: outside any savepoint). Messages staged
    /// in the handler's own transaction outside any savepoint are kept, so that the dispatch
    /// after the commit publishes them without reading them back; anything staged elsewhere
    /// (in a savepoint that may roll back, in another transaction) makes the dispatch read
    /// what was committed instead.
    #[doc(hidden)]
    pub fn keep_staged(&self, messages: &[Outgoing], transaction: usize, depth: usize) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        // A scheduled message is the relay's to publish when it is due: the run is then
        // dispatched from the outbox, which holds it back.
        let now = super::clock::epoch_ms();
        let scheduled = messages.iter().any(|m| m.scheduled_after(now).is_some());
        match (
            &mut *kept,
            self.transaction == Some(transaction) && depth == 1 && !scheduled,
        ) {
            (Some(kept), true) => kept.extend_from_slice(messages),
            (kept, _) => *kept = None,
        }
    }

    /// The messages staged in the handler's own transaction, in order, when every message
    /// staged in this run was staged there outside any savepoint, through this context; `None`
    /// otherwise. For a batch handler's context that is every message its items stamped too
    /// (as `stage_all` stages them); one staged through an item's context makes it `None`,
    /// since the order between the two is not kept.
    pub(crate) fn kept(&self) -> Option<Vec<Outgoing>> {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner()).take();
        kept.filter(|kept| kept.len() == self.staged() as usize)
    }

    /// This context with its staged messages grouped under `run` for their dispatch (the
    /// runtime groups a batch's under its first key; a context from [`Context::new`] groups
    /// under its own key).
    pub fn with_run(self, run: &'a str) -> Self {
        Self { run, ..self }
    }

    /// This context as a batch handler's: `items` are the contexts of the batch's messages,
    /// in order ([`Context::item`]).
    pub fn with_items(self, items: &'a [Context<'a>]) -> Self {
        Self { items, ..self }
    }

    /// The context of message `index` of a batch handler's batch, to stage what that message
    /// causes (`idem::outbox::stage(tx, ctx.item(i)?, …)`); for a single message's context,
    /// itself at index 0.
    pub fn item(&self, index: usize) -> Option<&Context<'a>> {
        match self.items.is_empty() {
            true => (index == 0).then_some(self),
            false => self.items.get(index),
        }
    }

    /// The key staged rows are grouped under for their dispatch.
    pub fn run_key(&self) -> &'a str {
        self.run
    }

    /// This context with `state` (a context from [`Context::new`] holds none).
    pub fn with_state(self, state: &'a State) -> Self {
        Self { state, ..self }
    }

    /// This context with the outbox table of the handler's store, where
    /// [`Context::outgoing`] messages are staged (a context from [`Context::new`] names none:
    /// the store's default is used).
    pub fn with_outbox(self, table: Option<&'a str>) -> Self {
        Self {
            outbox: table,
            ..self
        }
    }

    /// The outbox table of the handler's store, when the runtime named one.
    pub fn outbox_table(&self) -> Option<&'a str> {
        self.outbox
    }

    /// `message`, stamped as a message caused by this delivery, for the outbox: without a
    /// message id it gets [`outbox_message_id`]`(consumer, key, n)` for the n-th message
    /// stamped in this run (so a re-run after a rollback stamps the same ids); without a
    /// correlation id, this delivery's correlation id, else its message id; the header
    /// `causation_id` is this delivery's message id; `traceparent` is the current span's context
    /// with the `opentelemetry` feature and a `tracing-opentelemetry` layer, else copied when
    /// this delivery has one (a `traceparent` the message already has is kept).
    pub fn outgoing(&self, message: Outgoing) -> Outgoing {
        let ordinal = self.staged.fetch_add(1, Ordering::Relaxed);
        let mut message = message;
        let envelope = &mut message.envelope;
        if envelope.message_id.is_none() {
            // A batch handler's own context derives its ids apart from its messages' contexts
            // (the first of which has the same key), so the two never stamp one id.
            envelope.message_id = Some(match self.items.is_empty() {
                true => outbox_message_id(self.consumer, self.key, ordinal),
                false => batch_message_id(self.consumer, self.key, ordinal),
            });
        }
        if envelope.correlation_id.is_none() {
            envelope.correlation_id = self
                .correlation_id()
                .or(self.message_id())
                .map(str::to_owned);
        }
        if let Some(cause) = self.message_id()
            && envelope.headers.get(CAUSATION_HEADER).is_none()
        {
            envelope.headers.insert(CAUSATION_HEADER, cause);
        }
        if envelope.headers.get(TRACEPARENT_HEADER).is_none()
            && !super::propagation::inject_current(&mut envelope.headers)
            && let Some(trace) = self.header(TRACEPARENT_HEADER)
        {
            envelope.headers.insert(TRACEPARENT_HEADER, trace.clone());
        }
        message
    }

    /// How many messages [`Context::outgoing`] stamped in this run (for a batch handler's
    /// context, with those of its messages).
    pub fn staged(&self) -> u32 {
        let items: u32 = self.items.iter().map(Context::staged).sum();
        self.staged.load(Ordering::Relaxed) + items
    }

    /// The runtime's state value of type `T` (what a handler parameter `&T` receives).
    pub fn state<T: Send + Sync + 'static>(&self) -> Option<&'a T> {
        self.state.get()
    }

    /// The dedup key of this message. Pass it downstream as an idempotency key so the next
    /// tier can deduplicate too.
    pub fn idempotency_key(&self) -> &'a str {
        self.key
    }

    /// The consumer identity that scopes the key.
    pub fn consumer(&self) -> &'a str {
        self.consumer
    }

    /// The message id property.
    pub fn message_id(&self) -> Option<&'a str> {
        self.envelope.message_id.as_deref()
    }

    /// The correlation id property.
    pub fn correlation_id(&self) -> Option<&'a str> {
        self.envelope.correlation_id.as_deref()
    }

    /// A header by exact name.
    pub fn header(&self, name: &str) -> Option<&'a HeaderValue> {
        self.envelope.headers.get(name)
    }

    /// Which attempt this is: 1, plus one for each transient failure before it (a redelivery
    /// of the same copy is the same attempt; see [`Envelope::attempt`]).
    pub fn attempt(&self) -> u32 {
        self.envelope.attempt
    }

    /// The whole envelope.
    pub fn envelope(&self) -> &'a Envelope {
        self.envelope
    }
}

/// The value of type `T` the context's runtime holds, for a handler parameter `&T`. Missing
/// (the handler was run outside a runtime that checked it): a transient error, so the message
/// is retried and then dead-lettered, never lost.
pub fn extract_state<'a, T: Send + Sync + 'static>(
    ctx: &Context<'a>,
) -> Result<&'a T, HandlerError> {
    ctx.state::<T>().ok_or_else(|| {
        HandlerError::transient(format!(
            "no state of type `{}` was given to the runtime (RuntimeBuilder::state)",
            std::any::type_name::<T>()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::destination::Destination;

    fn stamped(ctx: &Context<'_>) -> Outgoing {
        ctx.outgoing(Outgoing::new(Destination::queue("q"), "x"))
    }

    /// A batch handler staging through the batch's own context and through its first
    /// message's context (the same key) gets two ids, and the same two on a re-run.
    #[test]
    fn a_batch_context_and_its_first_item_never_stamp_one_id() {
        let envelope = Envelope::new(b"{}".to_vec());
        let ids = || {
            let items = [
                Context::new(&envelope, "billing", "k1"),
                Context::new(&envelope, "billing", "k2"),
            ];
            let batch = Context::new(&envelope, "billing", "k1").with_items(&items);
            let first = batch.item(0).expect("the first item");
            [
                stamped(&batch),
                stamped(first),
                stamped(&batch),
                stamped(first),
            ]
            .map(|m| m.message_id().map(str::to_owned))
        };
        let once = ids();
        let distinct: std::collections::HashSet<_> = once.iter().collect();
        assert_eq!(distinct.len(), 4, "{once:?}");
        assert_eq!(once, ids(), "a re-run stamps the same ids");
    }

    /// Only a run whose every message was staged in the handler's own transaction, outside any
    /// savepoint, is kept for a dispatch from memory.
    #[test]
    fn only_messages_staged_in_the_handlers_own_transaction_are_kept() {
        let envelope = Envelope::new(b"{}".to_vec());
        let run = |stage: &dyn Fn(&Context<'_>)| {
            let ctx = Context::new(&envelope, "c", "k").with_transaction(Some(7));
            stage(&ctx);
            ctx.kept().map(|kept| kept.len())
        };
        let own = |ctx: &Context<'_>| ctx.keep_staged(&[stamped(ctx)], 7, 1);
        assert_eq!(run(&|ctx| (own(ctx), own(ctx)).1), Some(2));
        let savepoint = |ctx: &Context<'_>| ctx.keep_staged(&[stamped(ctx)], 7, 2);
        assert_eq!(run(&|ctx| (own(ctx), savepoint(ctx), own(ctx)).2), None);
        let other = |ctx: &Context<'_>| ctx.keep_staged(&[stamped(ctx)], 8, 1);
        assert_eq!(run(&|ctx| (other(ctx), own(ctx)).1), None);
        // Stamped but not staged (or its staging failed): what was committed is read back.
        assert_eq!(run(&|ctx| (stamped(ctx), own(ctx)).1), None);
        let unnamed = Context::new(&envelope, "c", "k");
        unnamed.keep_staged(&[stamped(&unnamed)], 7, 1);
        assert!(
            unnamed.kept().is_none(),
            "a store that names no transaction"
        );
    }

    #[test]
    fn the_context_reads_its_state() {
        let mut state = State::new();
        state.insert(String::from("config"));
        let envelope = Envelope::new("{}");
        let bare = Context::new(&envelope, "billing", "k");
        assert!(bare.state::<String>().is_none());
        assert!(extract_state::<String>(&bare).is_err());
        let ctx = bare.with_state(&state);
        assert_eq!(ctx.state::<String>().map(String::as_str), Some("config"));
        assert_eq!(
            extract_state::<String>(&ctx).ok().map(String::as_str),
            Some("config")
        );
    }
}
