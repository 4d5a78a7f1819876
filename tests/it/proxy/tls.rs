//! TLS towards the proxy's clients: a certificate of a private CA (made here with openssl),
//! lapin over amqps:// verifying it, and no plain AMQP on that port; and towards an amqps://
//! broker: a second proxy whose --url is the first, over TLS, with `tls.ca_file`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::TlsSettings;

use super::*;

/// A CA and a certificate for localhost / 127.0.0.1 signed by it, in `dir`.
fn make_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let (ca, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let (cert, key, csr) = (
        dir.join("proxy.pem"),
        dir.join("proxy.key"),
        dir.join("proxy.csr"),
    );
    let ext = dir.join("san.ext");
    std::fs::write(&ext, "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl is required");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let p = |x: &PathBuf| x.to_str().unwrap().to_string();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=proxy-test-ca",
        "-keyout",
        &p(&ca_key),
        "-out",
        &p(&ca),
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        &p(&key),
        "-out",
        &p(&csr),
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        &p(&csr),
        "-CA",
        &p(&ca),
        "-CAkey",
        &p(&ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p(&ext),
        "-out",
        &p(&cert),
    ]);
    (ca, cert, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_connect_with_tls_and_never_in_plain() {
    within(tls_body()).await;
}

async fn tls_body() {
    let mut w = World::new(&["tls"]).await;
    let dir = std::env::temp_dir().join(format!("{}-proxy-tls", w.env.settings.prefix));
    let (ca, cert, key) = make_certs(&dir);
    let proxy = ProxyProc::start(
        &w.env,
        &w.config.0,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let url = proxied_url("amqps", "localhost", proxy.port);
    let tls = TlsSettings {
        ca_file: Some(ca.clone()),
        ..TlsSettings::default()
    };
    let connector = Connector::with_tls(&url, &tls).unwrap();
    let mut app = None;
    for _ in 0..100 {
        if let Ok(c) = connector.connect("proxy tls test").await {
            app = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let app =
        app.unwrap_or_else(|| panic!("no TLS connection through the proxy:\n{}", proxy.log()));
    let x = w.exchange("tls");
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    let sent = publish_all(
        &app,
        &x,
        "k",
        vec![(300, b"over tls".to_vec(), with_delay(Some(300), "t"))],
    )
    .await;
    let got = collect(
        &app,
        &q,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    check(&sent, &got);
    let _ = app.close(200, "bye".into()).await;

    // without verification material the proxy's certificate is refused; plain AMQP gets nothing
    let untrusted = Connector::with_tls(&url, &TlsSettings::default()).unwrap();
    assert!(untrusted.connect("untrusted").await.is_err());
    let plain = proxied_url("amqp", "127.0.0.1", proxy.port);
    assert!(
        amqp_delay::ops::connection::connect(&plain, "plain")
            .await
            .is_err()
    );
    let _ = std::fs::remove_dir_all(&dir);
    w.env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_reaches_an_amqps_broker_with_verified_tls() {
    within(upstream_tls_body()).await;
}

async fn upstream_tls_body() {
    let mut w = World::new(&["chained"]).await;
    let dir = std::env::temp_dir().join(format!("{}-proxy-tls-up", w.env.settings.prefix));
    let (ca, cert, key) = make_certs(&dir);
    // the "broker" speaking TLS is a first proxy in front of the real one
    let front = ProxyProc::start(
        &w.env,
        &w.config.0,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let tls_url = proxied_url("amqps", "localhost", front.port);
    let ca_text = ca.to_str().unwrap();
    let chained = ProxyProc::start_at(
        &w.env,
        &w.config.0,
        &tls_url,
        &[],
        &[("AMQP_DELAY_TLS__CA_FILE", ca_text)],
    );
    let app = chained.connect().await;
    let x = w.exchange("chained");
    declare_delayed(&app, &x, "direct").await;
    let q = w.env.queue("app").await;
    bind(&w.env.conn, &q, &x, "k").await;
    let sent = publish_all(
        &app,
        &x,
        "k",
        vec![(300, b"chained".to_vec(), with_delay(Some(300), "c"))],
    )
    .await;
    let got = collect(
        &app,
        &q,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    check(&sent, &got);
    let _ = app.close(200, "bye".into()).await;

    // a client's upstream connection verifies too: without the CA the handshake fails, with
    // it the certificate must name the host
    let addr = ("127.0.0.1", front.port);
    let none = amqp_delay_cli::tls::connector(&TlsSettings::default()).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(
        amqp_delay_cli::tls::connect(&none, tcp, "localhost")
            .await
            .is_err()
    );
    let with_ca = TlsSettings {
        ca_file: Some(ca.clone()),
        ..TlsSettings::default()
    };
    let ours = amqp_delay_cli::tls::connector(&with_ca).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(
        amqp_delay_cli::tls::connect(&ours, tcp, "other.example")
            .await
            .is_err()
    );
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(
        amqp_delay_cli::tls::connect(&ours, tcp, "localhost")
            .await
            .is_ok()
    );

    // without the CA, the front's certificate is refused: the proxy does not start
    let mut untrusted = ProxyProc::start_at(&w.env, &w.config.0, &tls_url, &[], &[]);
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = untrusted.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            std::time::Instant::now() < end,
            "a proxy with an unverifiable upstream runs:\n{}",
            untrusted.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success());
    let log = untrusted.log();
    assert!(log.to_lowercase().contains("certificate"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
    w.env.cleanup().await;
}
