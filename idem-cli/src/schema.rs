//! `idem schema`: the SQL that creates the inbox's tables, for a migration tool of your own.

use crate::args::Cli;
use crate::error::CliError;
use idem::sql::TableName;
use idem::sql::dialect::{self, Dialect, Entry, WithDialect};

/// Prints the statements that create `cli.table` at this idem's schema version, in `dialect`
/// (else the one `DATABASE_URL` names), each ended by `;`.
pub fn print(cli: &Cli, dialect: Option<&str>) -> Result<(), CliError> {
    let table = TableName::new(&cli.table)
        .map_err(|e| CliError::Usage(format!("IDEM_INBOX_TABLE: {e}")))?;
    let url = cli.database_url.as_str();
    let printed = match dialect {
        Some(name) => dialect::by_name(name, Print { table: &table }),
        None => dialect::by_url(url, Print { table: &table }),
    };
    printed.map_err(|e| {
        CliError::Usage(format!(
            "{e}: name the database of DATABASE_URL with a known scheme, or with --dialect"
        ))
    })
}

/// Prints the schema of `table` in a dialect.
struct Print<'a> {
    table: &'a TableName,
}

impl WithDialect for Print<'_> {
    type Output = ();

    fn run<D: Dialect>(self, entry: &'static Entry) {
        let how = match entry.transactional_ddl {
            true => "run them in one transaction",
            false => "the database commits each statement by itself; each can be run again",
        };
        println!(
            "-- idem inbox `{}`, schema version {}, {}: {how}.",
            self.table.as_str(),
            idem::sql::SCHEMA_VERSION,
            entry.name
        );
        for statement in idem::sql::schema::<D>(self.table) {
            println!("{statement};\n");
        }
    }
}
