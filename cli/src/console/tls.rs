//! HTTPS: the console's listener when given `--tls-cert` and `--tls-key` (rustls with ring,
//! loaded as `delay-proxy` loads its own: [`crate::tls::acceptor`]). With them the
//! console speaks TLS only; a plain HTTP client gets no page. Handshakes run in tasks of their
//! own (at most [`MAX_HANDSHAKES`] at once, each within [`HANDSHAKE_TIMEOUT`]), so a slow or
//! silent client never holds up the others.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::tls::TlsAcceptor;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};

use crate::tls::{ClientTls, accept};

/// Handshakes under way at most; more connections wait in the kernel's backlog.
pub const MAX_HANDSHAKES: usize = 64;
/// How long a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP listener whose connections are handed on once their TLS handshake is done.
pub struct TlsListener {
    ready: mpsc::Receiver<(ClientTls, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener`, handshaking with `acceptor`.
    pub fn new(listener: TcpListener, acceptor: TlsAcceptor) -> TlsListener {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (tx, ready) = mpsc::channel(MAX_HANDSHAKES);
        tokio::spawn(accept_loop(listener, acceptor, tx));
        TlsListener { ready, local }
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    tx: mpsc::Sender<(ClientTls, SocketAddr)>,
) {
    let gate = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = gate.clone().acquire_owned().await else {
            return;
        };
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("console: accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if tx.is_closed() {
            return;
        }
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept(&acceptor, tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = tx.send((stream, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, "console: TLS handshake failed: {e}"),
                Err(_) => tracing::debug!(%peer, "console: TLS handshake timed out"),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = ClientTls;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // the accept loop ended (it never does while the listener lives): stop here
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
