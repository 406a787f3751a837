//! Opening the inbox named by `DATABASE_URL`, in its own dialect.

use crate::args::Cli;
use crate::error::CliError;
use idem::sql::{Dialect, MySqlInbox, PgInbox, SCHEMA_VERSION, SqlInbox, SqliteInbox};
use idem::store::InboxStore;
use idem::telemetry::redact_url;

/// Connects to the database of `cli` and runs its command there.
pub async fn dispatch(cli: &Cli) -> Result<(), CliError> {
    let url = cli.database_url.as_str();
    let failed = |e: &dyn std::fmt::Display| CliError::Database {
        url: redact_url(url),
        message: e.to_string(),
    };
    let table = |e: idem::sql::ConfigError| CliError::Usage(format!("IDEM_INBOX_TABLE: {e}"));
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let options = idem::sql::urls::postgres_options(url).map_err(|e| failed(&e))?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .map_err(|e| failed(&e))?;
        run_checked(cli, PgInbox::new(pool).table(&cli.table).map_err(table)?).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .map_err(|e| failed(&e))?;
        run_checked(cli, MySqlInbox::new(pool).table(&cli.table).map_err(table)?).await
    } else if url.starts_with("sqlite:") || !url.contains("://") {
        let pool = idem::sql::sqlite::pool(url).await.map_err(|e| failed(&e))?;
        run_checked(
            cli,
            SqliteInbox::new(pool).table(&cli.table).map_err(table)?,
        )
        .await
    } else {
        Err(CliError::Usage(format!(
            "DATABASE_URL {} is not a postgres://, mysql:// or sqlite: URL",
            redact_url(url)
        )))
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
