//! Triggers that make a store refuse the claim of one key, with an error that retrying will not
//! fix: for tests of what a store's refusal of one message does to the others.

/// Statements that make PostgreSQL refuse the claim of `key` in the inbox `table`.
pub fn postgres(table: &str, key: &str) -> Vec<String> {
    vec![
        format!(
            "CREATE OR REPLACE FUNCTION {table}_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'refused by the test' USING ERRCODE = '22023'; END $$"
        ),
        format!(
            "CREATE TRIGGER {table}_refuse BEFORE INSERT ON {table} FOR EACH ROW
             WHEN (NEW.key = '{key}') EXECUTE FUNCTION {table}_refuse()"
        ),
    ]
}

/// Statements that make MariaDB refuse the claim of `key` in the inbox `table`.
pub fn mysql(table: &str, key: &str) -> Vec<String> {
    vec![format!(
        "CREATE TRIGGER {table}_refuse BEFORE INSERT ON {table} FOR EACH ROW
         BEGIN IF NEW.`key` = '{key}' THEN
           SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test';
         END IF; END"
    )]
}

/// Statements that make SQLite refuse the claim of `key` in the inbox `table`.
pub fn sqlite(table: &str, key: &str) -> Vec<String> {
    vec![format!(
        "CREATE TRIGGER {table}_refuse BEFORE INSERT ON {table} WHEN NEW.key = '{key}'
         BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    )]
}
