//! Hostile input and security against real peers: TLS is never skipped (a fake server sees a TLS
//! handshake, never the AMQP header or a password), verification is on by default and follows
//! `tls.ca_file`, a client certificate works. The TLS node is our own (`scripts/tls-node.sh`),
//! beside the main broker.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::TlsSettings;
use tokio::io::AsyncReadExt;

/// The `KEY=VALUE` lines of `scripts/tls-node.sh up` (started once per test run).
pub(crate) fn tls_node() -> &'static HashMap<String, String> {
    static NODE: OnceLock<HashMap<String, String>> = OnceLock::new();
    NODE.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/tls-node.sh");
        let out = std::process::Command::new("bash")
            .args([script, "up"])
            .output()
            .expect("running scripts/tls-node.sh");
        assert!(
            out.status.success(),
            "THE TLS TEST NODE DID NOT START (scripts/tls-node.sh up, needs root and the rabbitmq-server package):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

fn path(key: &str) -> Option<PathBuf> {
    Some(PathBuf::from(&tls_node()[key]))
}

async fn try_tls(tls: TlsSettings) -> amqp_delay::Result<()> {
    let url = tls_node()["AMQPS_URL"].clone();
    let conn = Connector::with_tls(&url, &tls)?.connect("tls test").await?;
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_never_sends_the_amqp_header_or_the_password_in_clear() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        // read whatever the client sends for a moment, then hang up
        let _ = tokio::time::timeout(Duration::from_millis(1500), async {
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        got
    });
    let url = format!("amqps://guest:s3cr3t-pw@127.0.0.1:{port}/%2f");
    let r = Connector::with_tls(&url, &TlsSettings::default())
        .unwrap()
        .connect("fake server test")
        .await;
    assert!(r.is_err(), "connected to a server that speaks no TLS");
    let got = server.await.unwrap();
    assert!(!got.is_empty(), "the client sent nothing");
    assert_eq!(got[0], 0x16, "the first byte is not a TLS handshake record");
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains("AMQP"), "the AMQP header went out in clear");
    assert!(
        !text.contains("s3cr3t-pw"),
        "the password went out in clear"
    );
    // and amqps:// against a plain AMQP broker fails instead of "working"
    let plain = Connector::with_tls(
        "amqps://guest:guest@127.0.0.1:5672/%2f",
        &TlsSettings::default(),
    )
    .unwrap()
    .connect("plain broker test")
    .await;
    assert!(plain.is_err(), "amqps:// worked against a plain broker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_certificate_is_verified_against_the_configured_ca() {
    // the system's CAs do not know the throwaway CA: refused
    let e = try_tls(TlsSettings::default()).await.unwrap_err();
    assert!(
        amqp_delay::error_chain(&e).contains("cannot connect"),
        "{e}"
    );
    // the right CA: accepted
    try_tls(TlsSettings {
        ca_file: path("CA_CERT"),
        ..TlsSettings::default()
    })
    .await
    .expect("the configured CA verifies the server");
    // another CA: refused
    assert!(
        try_tls(TlsSettings {
            ca_file: path("WRONG_CA_CERT"),
            ..TlsSettings::default()
        })
        .await
        .is_err()
    );
    // a client certificate the server trusts: accepted; one it does not: refused
    try_tls(TlsSettings {
        ca_file: path("CA_CERT"),
        client_cert: path("CLIENT_CERT"),
        client_key: path("CLIENT_KEY"),
    })
    .await
    .expect("client certificate accepted");
    assert!(
        try_tls(TlsSettings {
            ca_file: path("CA_CERT"),
            client_cert: path("WRONG_CLIENT_CERT"),
            client_key: path("WRONG_CLIENT_KEY"),
        })
        .await
        .is_err()
    );
    // a missing file is named
    let e = Connector::with_tls(
        "amqps://h/",
        &TlsSettings {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..TlsSettings::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
}

/// The management API over https (what `stats` and `teardown` use to count held messages)
/// verifies the server against `tls.ca_file` too: an `openssl s_server` with the TLS node's
/// server certificate stands in for it (it answers every request with a status page, so a
/// verified handshake ends in "not the management API", a refused one in a certificate error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_management_api_over_https_is_verified_against_the_configured_ca() {
    use amqp_delay::ops::management::Management;

    let cert = PathBuf::from(&tls_node()["SERVER_CERT"]);
    let key = cert.with_extension("key");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut server = tokio::process::Command::new("openssl")
        .args(["s_server", "-quiet", "-www", "-accept"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("openssl s_server");
    let mut up = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "openssl s_server did not listen on {port}");
    let endpoint = format!("https://localhost:{port}/");
    let query = |tls: TlsSettings| {
        let endpoint = endpoint.clone();
        async move {
            let m = Management::new("amqps://guest:guest@localhost/%2f", Some(&endpoint))
                .unwrap()
                .with_tls(&tls)?;
            m.queues("x.").await.map(|_| ())
        }
    };
    // the public roots do not know the throwaway CA
    let e = query(TlsSettings::default()).await.unwrap_err().to_string();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // the wrong CA: refused
    let e = query(TlsSettings {
        ca_file: path("WRONG_CA_CERT"),
        ..TlsSettings::default()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // the right CA: the handshake passes, and the page is not the management API's JSON
    let e = query(TlsSettings {
        ca_file: path("CA_CERT"),
        ..TlsSettings::default()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(!e.to_lowercase().contains("certificate"), "{e}");
    eprintln!("verified handshake, then: {e}");
    // a CA file without a certificate is named
    let e = query(TlsSettings {
        ca_file: path("CLIENT_KEY"),
        ..TlsSettings::default()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("holds no PEM certificate"), "{e}");
    let _ = server.kill().await;
}
