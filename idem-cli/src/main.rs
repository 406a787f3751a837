//! `idem`, the operator tool of idem: dead letters with their reasons (list, show, replay),
//! inbox rows (stats, show, forget, sweep), parked outbox rows (parked, release) and the inbox's
//! DDL (schema), configured like the services it looks after
//! (`AMQP_URL`, `DATABASE_URL`). `idem --help` and `idem <command> --help` say the rest.

mod args;
mod broker;
mod dlq;
mod error;
mod inbox;
mod outbox;
mod output;
mod release;
mod replay;
mod schema;
mod store;

use args::{Cli, Command};
use clap::Parser;
use error::CliError;
use idem::sql::{Dialect, SqlInbox};
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    // A broker URL of no known broker is a usage error before anything is opened.
    let checked = match &cli.command {
        Command::Dlq(_) => broker::kind(&cli).map(|_| ()),
        _ => Ok(()),
    };
    let ran = match (checked, &cli.command) {
        (Ok(()), Command::Schema { dialect }) => schema::print(&cli, dialect.as_deref()),
        (Ok(()), _) => store::dispatch(&cli).await,
        (Err(e), _) => Err(e),
    };
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `cli`'s command against `inbox`, whatever its database.
async fn run<DB: Dialect>(cli: &Cli, inbox: SqlInbox<DB>) -> Result<(), CliError> {
    match &cli.command {
        Command::Dlq(command) => dlq::run(cli, &inbox, command).await,
        Command::Inbox(command) => inbox::run(cli, &inbox, command).await,
        Command::Outbox(command) => outbox::run(cli, &inbox, command).await,
        Command::Schema { dialect } => schema::print(cli, dialect.as_deref()),
    }
}
