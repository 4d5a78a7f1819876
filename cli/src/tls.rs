//! TLS for the tools, in one place: rustls with the ring provider (as the library's own
//! connections), through tokio-rustls. Towards clients (`--tls-cert`, `--tls-key` of
//! `delay-proxy` and `delay-console`): a certificate chain and key in PEM; with them, a listener
//! speaks TLS only, a plain client is never served. Towards an `amqps://` broker (the proxy's
//! upstream): the system's CA certificates plus `tls.ca_file`, the client certificate of
//! `tls.client_cert` and `tls.client_key`, verification always on.

use std::path::Path;
use std::sync::Arc;

use amqp_delay::Error;
use amqp_delay::Result;
use amqp_delay::settings::TlsSettings;
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
pub use tokio_rustls::{TlsAcceptor, TlsConnector};

/// A settings error: what the TLS files or settings got wrong.
fn config(why: impl Into<String>) -> Error {
    Error::from(amqp_delay::settings::SettingsError::Invalid(why.into()))
}

/// A client's TLS stream.
pub type ClientTls = tokio_rustls::server::TlsStream<TcpStream>;

/// The acceptor of the chain in `cert` and the key in `key`.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    let bad = |what: &Path, e: &dyn std::fmt::Display| {
        config(format!("TLS: reading '{}': {e}", what.display()))
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, &e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, &e))?;
    if certs.is_empty() {
        return Err(bad(cert, &"no certificate in it"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(|e| {
            config(format!(
                "TLS: the certificate and key do not go together: {e}"
            ))
        })?;
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// The TLS handshake with a client.
pub async fn accept(acceptor: &TlsAcceptor, tcp: TcpStream) -> std::io::Result<ClientTls> {
    acceptor.accept(tcp).await
}

/// A TLS stream to the broker.
pub type BrokerTls = tokio_rustls::client::TlsStream<TcpStream>;

/// The connector towards `amqps://` brokers, from the settings' `[tls]`.
pub fn connector(tls: &TlsSettings) -> Result<TlsConnector> {
    tls.validate().map_err(config)?;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if let Some(ca) = &tls.ca_file {
        let read = CertificateDer::pem_file_iter(ca)
            .map_err(|e| config(format!("TLS: reading tls.ca_file '{}': {e}", ca.display())))?;
        for cert in read {
            let cert = cert
                .map_err(|e| config(format!("TLS: reading tls.ca_file '{}': {e}", ca.display())))?;
            roots
                .add(cert)
                .map_err(|e| config(format!("TLS: a CA of '{}': {e}", ca.display())))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| config(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    let client = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            let certs = CertificateDer::pem_file_iter(cert)
                .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
                .map_err(|e| config(format!("TLS: reading '{}': {e}", cert.display())))?;
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| config(format!("TLS: reading '{}': {e}", key.display())))?;
            builder
                .with_client_auth_cert(certs, key_der)
                .map_err(|e| config(format!("TLS: the client certificate: {e}")))?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(TlsConnector::from(Arc::new(client)))
}

/// The TLS handshake with the broker `host` (its certificate must name it).
pub async fn connect(
    connector: &TlsConnector,
    tcp: TcpStream,
    host: &str,
) -> std::io::Result<BrokerTls> {
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    connector.connect(name, tcp).await
}
