//! TLS for the wire client's `amqps://` connections, through the backend the features chose:
//! `tls-rustls` (ring, the system's roots), else `tls-native` (the platform's library), else none,
//! in which case `amqps://` is refused with the features to enable. Both trust the PEM
//! certificates of [`crate::RabbitConfig::tls_ca_pem`] besides the system's roots.

use idem_core::transport::TransportError;
use std::io;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// A byte stream to the broker: TCP, or TLS over TCP.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Stream for S {}

/// What `amqps://` says when idem was built without a TLS backend.
pub(crate) const NO_BACKEND: &str =
    "amqps:// needs TLS: enable the feature `tls-rustls` (a default) or `tls-native` of idem";

/// Whether this build can open `amqps://` connections.
pub(crate) const AVAILABLE: bool = cfg!(any(feature = "tls-rustls", feature = "tls-native"));

/// Refuses an `amqps://` broker when this build has no TLS backend (`available`), before any
/// connection is tried, with the features to enable.
pub(crate) fn check(config: &crate::RabbitConfig, available: bool) -> Result<(), TransportError> {
    if available || !config.urls.iter().any(|u| u.starts_with("amqps:")) {
        return Ok(());
    }
    Err(TransportError::Connection {
        broker: config.redacted_url(),
        url_variable: "AMQP_URL",
        source: NO_BACKEND.into(),
    })
}

#[cfg(any(feature = "tls-rustls", feature = "tls-native"))]
fn invalid(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// Wraps `tcp` in TLS for `host`, trusting the system's roots and `extra` (PEM).
#[cfg(feature = "tls-rustls")]
pub(crate) async fn wrap(
    host: &str,
    extra: Option<&str>,
    tcp: TcpStream,
) -> io::Result<Box<dyn Stream>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use std::sync::Arc;

    let mut roots = rustls::RootCertStore::empty();
    // Certificates the system store holds but rustls cannot use are skipped, as lapin does.
    let (_, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    if let Some(pem) = extra {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert.map_err(invalid)?).map_err(invalid)?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(invalid)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from(host.to_owned()).map_err(invalid)?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    Ok(Box::new(connector.connect(name, tcp).await?))
}

/// Wraps `tcp` in TLS for `host`, trusting the system's roots and `extra` (PEM).
#[cfg(all(feature = "tls-native", not(feature = "tls-rustls")))]
pub(crate) async fn wrap(
    host: &str,
    extra: Option<&str>,
    tcp: TcpStream,
) -> io::Result<Box<dyn Stream>> {
    let mut builder = native_tls::TlsConnector::builder();
    if let Some(pem) = extra {
        for cert in native_tls::Certificate::stack_from_pem(pem.as_bytes()).map_err(invalid)? {
            builder.add_root_certificate(cert);
        }
    }
    let connector = tokio_native_tls::TlsConnector::from(builder.build().map_err(invalid)?);
    Ok(Box::new(
        connector.connect(host, tcp).await.map_err(invalid)?,
    ))
}

/// Refuses `amqps://`: this build has no TLS backend.
#[cfg(not(any(feature = "tls-rustls", feature = "tls-native")))]
pub(crate) async fn wrap(
    _host: &str,
    _extra: Option<&str>,
    _tcp: TcpStream,
) -> io::Result<Box<dyn Stream>> {
    Err(io::Error::new(io::ErrorKind::Unsupported, NO_BACKEND))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RabbitConfig;

    #[test]
    fn amqps_without_a_backend_is_refused_naming_the_features() {
        let tls = RabbitConfig::new("amqps://guest:secret@broker:5671/%2f");
        let err = check(&tls, false).unwrap_err().to_string();
        assert!(
            err.contains("tls-rustls") && err.contains("tls-native"),
            "{err}"
        );
        assert!(!err.contains("secret"), "{err}");
        assert!(check(&tls, true).is_ok());
        assert!(check(&RabbitConfig::new("amqp://broker:5672/%2f"), false).is_ok());
    }
}
