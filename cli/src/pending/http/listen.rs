//! Serving HTTP/1 for `pending serve` and `delay-console`, on a listener of either (plain TCP,
//! or the console's TLS listener): each connection must send a request's headers within
//! [`HEADER_READ_TIMEOUT`] of opening or of its last answer, so slow or idle clients
//! (slowloris) cannot hold connections open; each request carries its client's address
//! (`ConnectInfo<SocketAddr>`, which the login throttle counts by). axum's own `serve` sets
//! no such timeout (hyper has one, but only with a timer, which it does not give).
//! A shutdown stops accepting, lets requests under way finish, and returns when every
//! connection has closed.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Extension};
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::watch;
use tower::Layer as _;

/// How long a client may take to send a request's headers, counted from when the connection
/// opened or answered its last request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` completes, then waits for open connections
/// to finish what they are answering.
pub async fn serve<L>(
    listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
{
    serve_with(listener, router, shutdown, HEADER_READ_TIMEOUT).await
}

/// [`serve`] with `header_timeout` for [`HEADER_READ_TIMEOUT`].
pub async fn serve_with<L>(
    mut listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_timeout: Duration,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
{
    let (closing, closed) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            c = listener.accept() => c,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(Extension(ConnectInfo(peer)).layer(router.clone()));
        let mut closed = closed.clone();
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(io), service);
            tokio::pin!(conn);
            let served = tokio::select! {
                r = conn.as_mut() => r,
                _ = closed.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
    drop(closed);
    let _ = closing.send(());
    closing.closed().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// Reads until the server closes the connection; what it sent. Panics if it is still open
    /// long after the header timeout (no timing is asserted: only that it closes).
    async fn until_closed(mut s: TcpStream) -> String {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut got));
        match read.await {
            Ok(_) => String::from_utf8_lossy(&got).into_owned(),
            Err(_) => panic!("the server kept a slow client's connection open"),
        }
    }

    #[tokio::test]
    async fn slow_and_idle_clients_are_closed_and_requests_carry_their_address() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let routes = Router::new().route(
            "/",
            get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let server = tokio::spawn(serve_with(
            listener,
            routes,
            shutdown,
            Duration::from_millis(300),
        ));
        // a whole request is answered, with the client's address
        let mut s = TcpStream::connect(addr).await.unwrap();
        let me = s.local_addr().unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = until_closed(s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with(&me.to_string()), "{answer}");
        // headers that never end, and a connection that never sends: both closed
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
            .await
            .unwrap();
        let idle = TcpStream::connect(addr).await.unwrap();
        let (slow, idle) = tokio::join!(until_closed(slow), until_closed(idle));
        assert!(
            !slow.contains("200") && !idle.contains("200"),
            "{slow} {idle}"
        );
        // a shutdown ends the server
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
