//! A handler written by hand: what every handler declares, the trait of its kind, and its
//! registration.
use idem::handler::{ExternalHandler, Handler, KeyError, KeySource, Registration, kind};
use idem::{Context, Envelope, HandlerError};
use std::time::Duration;

struct Mailer;

impl Handler for Mailer {
    type Store = idem::sql::PgInbox;
    type Payload = serde_json::Value;
    type Output = ();
    type Kind = kind::External;
    const NAME: &'static str = "mailer";
    const CONSUMER: &'static str = "mailer";
    const QUEUE: Option<&'static str> = None;
    const KEY: KeySource = KeySource::MessageId;

    fn key(envelope: &Envelope, _: &serde_json::Value) -> Result<String, KeyError> {
        Self::KEY.from_envelope(envelope)
    }
}

impl ExternalHandler for Mailer {
    const LEASE: Duration = Duration::from_secs(5);

    async fn call<'a>(_: serde_json::Value, _: &'a Context<'a>) -> Result<(), HandlerError> {
        Ok(())
    }
}

inventory::submit!(Registration::new(&Mailer));

fn main() {
    let mode = Registration::new(&Mailer).mode();
    assert_eq!(mode, idem::handler::Mode::External { lease: Duration::from_secs(5) });
}
