//! `idem schema`: the SQL that creates the inbox's tables, for a migration tool of your own.

use crate::args::Cli;
use crate::error::CliError;
use idem::sql::TableName;

/// Prints the statements that create `cli.table` at this idem's schema version, in `dialect`
/// (else the one `DATABASE_URL` names), each ended by `;`.
pub fn print(cli: &Cli, dialect: Option<&str>) -> Result<(), CliError> {
    let table = TableName::new(&cli.table)
        .map_err(|e| CliError::Usage(format!("IDEM_INBOX_TABLE: {e}")))?;
    let url = cli.database_url.as_str();
    let dialect = match dialect {
        Some(dialect) => dialect,
        None if url.starts_with("postgres://") || url.starts_with("postgresql://") => "postgres",
        None if url.starts_with("mysql://") || url.starts_with("mariadb://") => "mysql",
        None if url.starts_with("sqlite:") || !url.contains("://") => "sqlite",
        None => {
            return Err(CliError::Usage(
                "DATABASE_URL is not a postgres://, mysql:// or sqlite: URL: name the database with --dialect".to_owned(),
            ));
        }
    };
    let statements = match dialect {
        "postgres" => idem::sql::schema::<sqlx::Postgres>(&table),
        "mysql" => idem::sql::schema::<sqlx::MySql>(&table),
        _ => idem::sql::schema::<sqlx::Sqlite>(&table),
    };
    let how = match dialect {
        "mysql" => "MariaDB commits each statement by itself; each can be run again",
        _ => "run them in one transaction",
    };
    println!(
        "-- idem inbox `{}`, schema version {}, {dialect}: {how}.",
        table.as_str(),
        idem::sql::SCHEMA_VERSION
    );
    for statement in statements {
        println!("{statement};\n");
    }
    Ok(())
}
