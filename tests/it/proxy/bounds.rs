//! The proxy's memory is bounded before and after the login, whatever a client sends (issue
//! 43's attacks 5 and 6, replayed against a `delay-proxy` process whose resident memory is read
//! from `/proc/<pid>/status`), and its connection caps refuse what is over them. Before, a
//! forged `tune-ok` and a frame header of about 4 GiB grew the proxy by 523 MiB for 256 MiB
//! streamed, and publishes on channels 1–65535 before the login held about 56 MiB a connection.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::raw::{self, PROTOCOL_HEADER, RawClient};
use super::*;

/// The most attack 5 may grow the proxy's resident memory.
const ATTACK_5_BOUND: u64 = 64 << 20;
/// The most attack 6 may grow it.
const ATTACK_6_BOUND: u64 = 32 << 20;

/// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
fn status(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("a size in kB");
    kb * 1024
}

/// The proxy's resident memory now, with its peak reset to it (`clear_refs` 5), so that a later
/// `VmHWM` is the peak of what came after.
fn rss_now(pid: u32) -> u64 {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("resetting the peak RSS");
    status(pid, "VmRSS")
}

/// A proxy (no gateway: nothing is delivered here) and a delayed exchange it knows, warmed up.
struct Bench {
    env: Env,
    _config: ConfigFile,
    proxy: ProxyProc,
    x: String,
    _objects: GatewayObjects,
}

impl Bench {
    async fn new(extra: &[&str]) -> Bench {
        let env = Env::new(small_topology()).await;
        let config = write_config(&env, "");
        let proxy = ProxyProc::start(&env, &config.0, extra);
        let x = format!("{}-mem", env.settings.prefix);
        let ingress = env.layout().proxy_ingress(&x);
        let objects = GatewayObjects::new(&env, &[(ingress.as_str(), x.as_str())], &[&x]);
        let app = proxy.connect().await;
        declare_delayed(&app, &x, "direct").await;
        let _ = app.close(200, "bye".into()).await;
        Bench {
            env,
            _config: config,
            proxy,
            x,
            _objects: objects,
        }
    }

    fn pid(&self) -> u32 {
        self.proxy.child.id()
    }

    /// How much the proxy's peak resident memory grew over `before` (from [`rss_now`]).
    fn grown(&self, before: u64) -> u64 {
        status(self.pid(), "VmHWM").saturating_sub(before)
    }
}

/// Writes `total` bytes of zeros in 1 MiB writes until the proxy stops taking them (it closed
/// the connection, or reads no more); the bytes it took.
async fn stream(s: &mut TcpStream, total: usize) -> usize {
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0;
    while written < total {
        match tokio::time::timeout(Duration::from_secs(10), s.write_all(&chunk)).await {
            Ok(Ok(())) => written += chunk.len(),
            Ok(Err(_)) | Err(_) => break,
        }
    }
    written
}

/// A frame header claiming a method frame of about 4 GiB on channel 0.
const HUGE_FRAME: [u8; 7] = [1, 0, 0, 0xFF, 0xFF, 0xFF, 0xF0];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_frame_max_and_a_4_gib_frame_do_not_grow_the_proxy() {
    within(attack_5_body()).await;
}

async fn attack_5_body() {
    let b = Bench::new(&[]).await;
    // before any login: the tune-ok right after the protocol header
    let before = rss_now(b.pid());
    let mut s = TcpStream::connect(("127.0.0.1", b.proxy.port))
        .await
        .unwrap();
    let mut start = PROTOCOL_HEADER.to_vec();
    start.extend(raw::tune_ok(0xFFFF_FFF0));
    start.extend(HUGE_FRAME);
    let _ = s.write_all(&start).await;
    let taken = stream(&mut s, 256 << 20).await;
    drop(s);
    let grown = b.grown(before);
    eprintln!("attack 5 before the login: {taken} bytes taken, peak RSS grew {grown} bytes");
    assert!(
        grown <= ATTACK_5_BOUND,
        "grew {grown} bytes\n{}",
        b.proxy.log()
    );

    // logged in, the tune-ok asking for the same: frame_max is the proxy's cap all the same
    let before = rss_now(b.pid());
    let (user, password) = credentials()
        .split_once(':')
        .map(|(u, p)| (u.to_string(), p.to_string()))
        .unwrap();
    let mut c = RawClient::login(b.proxy.port, &user, &password, "/", 0xFFFF_FFF0).await;
    c.send(&HUGE_FRAME).await.unwrap();
    let mut taken = 0;
    let chunk = vec![0u8; 1 << 20];
    while taken < 256 << 20 {
        match tokio::time::timeout(Duration::from_secs(10), c.send(&chunk)).await {
            Ok(Ok(())) => taken += chunk.len(),
            Ok(Err(_)) | Err(_) => break,
        }
    }
    drop(c);
    let grown = b.grown(before);
    eprintln!("attack 5 after the login: {taken} bytes taken, peak RSS grew {grown} bytes");
    assert!(
        grown <= ATTACK_5_BOUND,
        "grew {grown} bytes\n{}",
        b.proxy.log()
    );
    // and what it took is given back once the connections are gone
    assert!(
        status(b.pid(), "VmRSS") <= before + ATTACK_5_BOUND,
        "{}",
        b.proxy.log()
    );
    b.env.cleanup().await;
}

/// Publishes to `x` on channels 1–65535, without content headers, after `first`.
fn publishes(first: &[u8], x: &str) -> Vec<u8> {
    let mut out = first.to_vec();
    for channel in 1..=u16::MAX {
        out.extend(raw::publish(channel, x));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_without_a_login_or_an_open_channel_are_not_held() {
    within(attack_6_body()).await;
}

async fn attack_6_body() {
    let b = Bench::new(&[]).await;
    let attack = publishes(PROTOCOL_HEADER, &b.x);
    // one connection, then eight at once
    for n in [1usize, 8] {
        let before = rss_now(b.pid());
        let sends = (0..n).map(|_| {
            let (port, attack) = (b.proxy.port, attack.clone());
            tokio::spawn(async move {
                let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
                let _ = tokio::time::timeout(Duration::from_secs(20), s.write_all(&attack)).await;
                // until the proxy closes it (or 10 s)
                let mut sink = vec![0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(10), async {
                    while let Ok(1..) = s.read(&mut sink).await {}
                })
                .await;
            })
        });
        futures::future::join_all(sends).await;
        let grown = b.grown(before);
        eprintln!("attack 6 before the login, {n} connection(s): peak RSS grew {grown} bytes");
        assert!(
            grown <= ATTACK_6_BOUND,
            "grew {grown} bytes\n{}",
            b.proxy.log()
        );
    }
    // logged in, on channels it never opened
    let before = rss_now(b.pid());
    let (user, password) = credentials()
        .split_once(':')
        .map(|(u, p)| (u.to_string(), p.to_string()))
        .unwrap();
    let mut c = RawClient::login(b.proxy.port, &user, &password, "/", 131_072).await;
    let _ = tokio::time::timeout(Duration::from_secs(20), c.send(&publishes(&[], &b.x))).await;
    while c.next_method().await.is_some() {}
    let grown = b.grown(before);
    eprintln!("attack 6 after the login, channels not opened: peak RSS grew {grown} bytes");
    assert!(
        grown <= ATTACK_6_BOUND,
        "grew {grown} bytes\n{}",
        b.proxy.log()
    );
    b.env.cleanup().await;
}

/// Connects from `ip` (a loopback address) and sends the protocol header: true when the
/// broker's `connection.start` comes back through the proxy, false when the proxy closes the
/// connection without a byte.
async fn admitted(port: u16, ip: &str) -> (bool, TcpStream) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    let mut s = socket
        .connect(([127, 0, 0, 1], port).into())
        .await
        .expect("connecting to delay-proxy");
    let _ = s.write_all(PROTOCOL_HEADER).await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
        .await
        .expect("neither an answer nor a close within 20 s");
    (matches!(read, Ok(n) if n > 0), s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_caps_are_refused() {
    within(caps_body()).await;
}

async fn caps_body() {
    let caps = [
        "--max-connections",
        "4",
        "--max-connections-per-address",
        "2",
        "--handshake-timeout",
        "60s",
    ];
    let b = Bench::new(&caps).await;
    let port = b.proxy.port;
    let mut open = Vec::new();
    for ip in ["127.0.0.1", "127.0.0.1"] {
        let (ok, s) = admitted(port, ip).await;
        assert!(ok, "{ip} refused under the caps\n{}", b.proxy.log());
        open.push(s);
    }
    assert!(
        !admitted(port, "127.0.0.1").await.0,
        "a third from one address"
    );
    for ip in ["127.0.0.2", "127.0.0.2"] {
        let (ok, s) = admitted(port, ip).await;
        assert!(ok, "{ip} refused under the caps\n{}", b.proxy.log());
        open.push(s);
    }
    assert!(!admitted(port, "127.0.0.3").await.0, "a fifth in all");
    assert_eq!(
        b.proxy.metric("amqp_delay_proxy_connections_refused_total"),
        2.0
    );
    assert!(
        b.proxy.log().contains("client connection refused"),
        "{}",
        b.proxy.log()
    );
    // one closes: room for one more from its address
    drop(open.remove(0));
    let end = Instant::now() + Duration::from_secs(10);
    while b.proxy.metric("amqp_delay_proxy_connections") > 3.0 {
        assert!(
            Instant::now() < end,
            "the closed connection is still counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(admitted(port, "127.0.0.1").await.0, "{}", b.proxy.log());
    drop(open);
    b.env.cleanup().await;
}
