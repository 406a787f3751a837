//! Secrets kept out of logs and error messages.

/// `url` with its secrets replaced by `***`, fit for logs and error messages: the password of
/// the user part (`scheme://user:password@host`, whatever characters the password holds), the
/// whole user part of a NATS URL (a token: `nats://token@host`), and query parameters that hold
/// a secret (`password`, `sslpassword`, any name with `password`, `token`, `secret` or `jwt` in
/// it). A list of URLs (`a, b`, as `AMQP_URL` may hold: split where a comma is followed by the
/// next URL's scheme) has each of them redacted.
pub fn redact_url(url: &str) -> String {
    let mut parts = Vec::new();
    let mut start = 0;
    for (at, _) in url.match_indices(',') {
        if starts_with_scheme(url[at + 1..].trim_start()) {
            parts.push(&url[start..at]);
            start = at + 1;
        }
    }
    parts.push(&url[start..]);
    parts
        .into_iter()
        .map(|part| {
            let trimmed = part.trim_start();
            let lead = &part[..part.len() - trimmed.len()];
            format!("{lead}{}", redact_one(trimmed))
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `text` begins with a URL scheme and `://`.
fn starts_with_scheme(text: &str) -> bool {
    let Some((scheme, _)) = text.split_once("://") else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// [`redact_url`] of one URL. The user part ends at the last `@` before the query: a password
/// may hold `/` or `,` unencoded (an `@` in the path is then taken for the end of a user part,
/// which shows less, never more).
fn redact_one(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut redacted = match (base.find("://"), base.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let scheme = &base[..scheme_end];
            let userinfo = &base[scheme_end + 3..at];
            let hidden = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None if token_scheme(scheme) => "***".to_owned(),
                None => userinfo.to_owned(),
            };
            format!("{scheme}://{hidden}{}", &base[at..])
        }
        _ => base.to_owned(),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if secret_parameter(name) => format!("{name}=***"),
                _ => param.to_owned(),
            })
            .collect();
        redacted = format!("{redacted}?{}", params.join("&"));
    }
    redacted
}

/// Whether a URL of `scheme` carries a token, not a user name, in a user part without a
/// password (NATS: `nats://token@host`).
fn token_scheme(scheme: &str) -> bool {
    matches!(
        scheme.to_ascii_lowercase().as_str(),
        "nats" | "tls" | "ws" | "wss"
    )
}

/// Whether a query parameter named `name` holds a secret.
fn secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "token", "secret", "jwt"]
        .iter()
        .any(|secret| name.contains(secret))
}

#[cfg(test)]
mod tests {
    use crate::telemetry::redact::redact_url;

    #[test]
    fn passwords_are_redacted() {
        for (url, redacted) in [
            (
                "amqp://guest:secret@h:5672/%2f",
                "amqp://guest:***@h:5672/%2f",
            ),
            ("amqp://h:5672", "amqp://h:5672"),
            ("postgres://app@db/x", "postgres://app@db/x"),
            (
                "postgres://app:p%40ss@db/x?sslmode=require",
                "postgres://app:***@db/x?sslmode=require",
            ),
            (
                "postgres://db/x?user=app&password=secret&x=1",
                "postgres://db/x?user=app&password=***&x=1",
            ),
            (
                "postgres://app@db/x?sslmode=verify-full&sslpassword=k3y&sslkey=/k.pem",
                "postgres://app@db/x?sslmode=verify-full&sslpassword=***&sslkey=/k.pem",
            ),
            ("sqlite://orders.db", "sqlite://orders.db"),
            (
                "nats://s3cret@nats.internal:4222",
                "nats://***@nats.internal:4222",
            ),
            (
                "tls://s3cret@nats.internal:4222",
                "tls://***@nats.internal:4222",
            ),
            ("nats://user:pw@h:4222", "nats://user:***@h:4222"),
            (
                "nats://h:4222?auth_token=t0k",
                "nats://h:4222?auth_token=***",
            ),
            (
                "amqp://u:p1@a:5672/%2f, amqp://u:p2@b:5673/%2f",
                "amqp://u:***@a:5672/%2f, amqp://u:***@b:5673/%2f",
            ),
            // A password with `,` or `/` in it, unencoded.
            ("postgres://app:pa,ss@db/x", "postgres://app:***@db/x"),
            ("postgres://app:pa/ss@db/x", "postgres://app:***@db/x"),
            (
                "amqp://u:p,1@a:5672/%2f,amqp://u:p2@b:5673/%2f",
                "amqp://u:***@a:5672/%2f,amqp://u:***@b:5673/%2f",
            ),
        ] {
            assert_eq!(redact_url(url), redacted, "{url}");
        }
    }
}
