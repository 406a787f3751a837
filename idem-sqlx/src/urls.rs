//! Database URLs as idem's tools read them: options built from the URL, with the parameters
//! sqlx ignores but prints left out, so that no secret reaches a log.

/// PostgreSQL connect options for `url` (`postgres://…`), without `sslpassword`: sqlx does not
/// support it (a client key protected by a password cannot be used), and warns of it with its
/// value. Its absence is logged instead, without the value.
#[cfg(feature = "postgres")]
pub fn postgres_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    use std::str::FromStr;
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, query),
        None => (url, ""),
    };
    let mut dropped = false;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|param| !param.is_empty())
        .filter(|param| {
            let unsupported = param
                .split_once('=')
                .map_or(*param, |(name, _)| name)
                .eq_ignore_ascii_case("sslpassword");
            dropped |= unsupported;
            !unsupported
        })
        .collect();
    if dropped {
        tracing::warn!(
            "DATABASE_URL names an sslpassword, which sqlx does not support: it is ignored (use a client key without a password)"
        );
    }
    let url = match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    };
    sqlx::postgres::PgConnectOptions::from_str(&url)
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    #[test]
    fn an_ssl_password_is_left_out() {
        let options =
            postgres_options("postgres://app@db:5432/x?sslpassword=s3cret&application_name=a")
                .unwrap();
        assert!(!format!("{options:?}").contains("s3cret"));
        assert_eq!(options.get_application_name(), Some("a"));
        assert_eq!(options.get_database(), Some("x"));
    }
}
