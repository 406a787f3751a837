//! Secrets kept out of logs and error messages.

/// `url` with its password replaced by `***`, fit for logs and error messages: the password of
/// the user part (`scheme://user:password@host`) and a `password=` query parameter.
pub fn redact_url(url: &str) -> String {
    let mut redacted = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    if let Some(query) = redacted.find('?') {
        let (base, params) = redacted.split_at(query + 1);
        let params: Vec<String> = params
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
                _ => param.to_owned(),
            })
            .collect();
        redacted = format!("{base}{}", params.join("&"));
    }
    redacted
}

#[cfg(test)]
mod tests {
    use super::redact_url;

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
            ("sqlite://orders.db", "sqlite://orders.db"),
        ] {
            assert_eq!(redact_url(url), redacted);
        }
    }
}
