//! A handler written by hand that declares a kind but not the trait of that kind is refused
//! where it is registered: there is no call to fall back on at run time.
use idem::handler::{Handler, KeyError, KeySource, Registration, kind};
use idem::Envelope;

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

static MAILER: Registration = Registration::new(&Mailer);

fn main() {
    let _ = &MAILER;
}
