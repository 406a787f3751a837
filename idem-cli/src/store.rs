//! Opening the inbox named by `DATABASE_URL`, in the dialect the table of dialects gives for
//! its URL (`idem::sql::dialect::DIALECTS`).

use crate::args::Cli;
use crate::error::CliError;
use idem::sql::dialect::{self, Dialect, Entry, WithDialect};
use idem::sql::{SCHEMA_VERSION, SqlInbox};
use idem::store::InboxStore;
use idem::telemetry::redact_url;
use idem::transport::BoxFuture;

/// Connects to the database of `cli` and runs its command there.
pub async fn dispatch(cli: &Cli) -> Result<(), CliError> {
    let url = cli.database_url.as_str();
    match dialect::by_url(url, Open { cli }) {
        Ok(opened) => opened.await,
        Err(e) => Err(CliError::Usage(format!("DATABASE_URL: {e}"))),
    }
}

/// Opens the inbox of `cli` in a dialect, and runs its command there.
struct Open<'a> {
    cli: &'a Cli,
}

impl<'a> WithDialect for Open<'a> {
    type Output = BoxFuture<'a, Result<(), CliError>>;

    fn run<D: Dialect>(self, _: &'static Entry) -> Self::Output {
        let cli = self.cli;
        Box::pin(async move {
            let pool = D::connect(&cli.database_url, 2)
                .await
                .map_err(|e| CliError::Database {
                    url: redact_url(&cli.database_url),
                    message: e.to_string(),
                })?;
            let inbox = SqlInbox::<D>::new(pool)
                .table(&cli.table)
                .map_err(|e| CliError::Usage(format!("IDEM_INBOX_TABLE: {e}")))?;
            run_checked(cli, inbox).await
        })
    }
}

/// Runs `cli`'s command once the inbox's tables are there, as this idem knows them.
async fn run_checked<DB: Dialect>(cli: &Cli, inbox: SqlInbox<DB>) -> Result<(), CliError> {
    if let Err(e) = inbox.check().await {
        return Err(CliError::Usage(format!(
            "{e}\nthe service creates and upgrades its inbox with `migrate()` (schema version \
             {SCHEMA_VERSION}); check DATABASE_URL ({}) and IDEM_INBOX_TABLE ({})",
            redact_url(&cli.database_url),
            cli.table
        )));
    }
    crate::run(cli, inbox).await
}
