//! TLS towards clients (`--tls-cert`, `--tls-key`): the proxy's certificate chain and key in
//! PEM, rustls with the ring provider (as the library's own connections). With them, the
//! listener speaks TLS only: a plain client is never served.

use std::path::Path;
use std::sync::Arc;

use amqp_delay::error::Result;
use async_compat::Compat;
use futures_rustls::TlsAcceptor;
use futures_rustls::server::TlsStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;

use super::config;

/// A client's TLS stream, as tokio reads and writes it.
pub type ClientTls = Compat<TlsStream<Compat<TcpStream>>>;

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
    let s = acceptor.accept(Compat::new(tcp)).await?;
    Ok(Compat::new(s))
}
