use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::LongString;
use amqp_delay::headers::{ADDED_USER_ID, PUBLISHED_AT};

use super::*;
use crate::proxy::frames::Split;

fn encode(frame: AMQPFrame) -> Vec<u8> {
    gen_frame(&frame)(WriteContext::from(Vec::new()))
        .unwrap()
        .write
}

/// The frames in `bytes`, parsed.
fn frames_of(bytes: &[u8]) -> Vec<(AMQPFrameType, u16, Vec<u8>)> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let Split::Frame(raw) = frames::split(rest) else {
            panic!("not whole frames")
        };
        out.push((raw.kind, raw.channel, raw.payload.to_vec()));
        rest = &rest[raw.len..];
    }
    out
}

/// Runs `f` on the frame `bytes` holds.
fn with_raw<T>(bytes: &[u8], f: impl FnOnce(&Raw<'_>) -> T) -> T {
    let Split::Frame(raw) = frames::split(bytes) else {
        panic!("not a frame")
    };
    f(&raw)
}

fn publish(exchange: &str) -> Vec<u8> {
    encode(AMQPFrame::Method(
        5,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: "rk".into(),
            mandatory: true,
            immediate: false,
        })),
    ))
}

fn header(x_delay: Option<AMQPValue>) -> Vec<u8> {
    let mut h = FieldTable::default();
    h.insert("keep".into(), AMQPValue::LongString(LongString::from("me")));
    if let Some(v) = x_delay {
        h.insert(X_DELAY.into(), v);
    }
    encode(AMQPFrame::Header(
        5,
        AMQPContentHeader {
            class_id: 60,
            body_size: 3,
            properties: BasicProperties::default().with_headers(h),
        },
    ))
}

fn pairs() -> Pairs {
    let p = Pairs::default();
    assert!(p.insert("orders", "p.gw.x.orders", &[]));
    assert!(!p.insert("orders", "p.gw.x.orders", &[]));
    p
}

/// The proxy's cap of `frame_max` in these tests.
const CAP: u32 = 131_072;

/// How a frame on an open channel of a tuned connection is seen.
fn seen(pairs: &Pairs, max_delay_ms: u64) -> Seen<'_> {
    Seen {
        pairs,
        max_delay_ms,
        open: true,
        offered: Some(Offer::of(CAP, 2047, CAP)),
    }
}

/// A client logged in as `app` in the proxy's virtual host, tuned to the cap.
fn client() -> ClientSide {
    let mut side = ClientSide::new("/");
    side.vhost = Some("/".into());
    side.user = Some("app".into());
    side.frame_max = Some(CAP);
    side
}

/// `p` without the time the proxy stamped on a delayed publish, or `None` when it has none.
fn unstamped(p: &BasicProperties) -> Option<BasicProperties> {
    let t = p.headers().clone()?;
    let at = t.inner().get(PUBLISHED_AT)?;
    let now = i64::try_from(amqp_delay::time::now_ms()).unwrap();
    assert!(
        matches!(at, AMQPValue::LongLongInt(ms) if (now - 60_000..=now).contains(ms)),
        "stamped now: {at:?}"
    );
    let rest = amqp_delay::headers::filter(&t, |k| k != PUBLISHED_AT);
    Some(p.clone().with_headers(rest))
}

/// What a publish to `exchange` followed by its header becomes: the exchange it goes to, and
/// whether the header frame is the one sent.
fn publish_through(exchange: &str, x_delay: Option<AMQPValue>) -> String {
    let (pairs, mut side) = (pairs(), client());
    let m = publish(exchange);
    let first = with_raw(&m, |r| side.frame(r, &seen(&pairs, 10_000))).unwrap();
    if first == Step::Pass {
        return exchange.to_string();
    }
    assert_eq!(first, Step::Held);
    let h = header(x_delay);
    let Step::Bytes(out) = with_raw(&h, |r| side.frame(r, &seen(&pairs, 10_000))).unwrap() else {
        panic!("the header releases the publish")
    };
    let frames = frames_of(&out);
    assert_eq!(frames.len(), 2);
    let sent = frames::content_header(&frames[1].2).unwrap();
    let mut want = frames::content_header(&h[7..h.len() - 1])
        .unwrap()
        .properties;
    let got = unstamped(&sent.properties);
    if got.is_some() {
        // to an ingress, naming the client's user
        let mut t = want.headers().clone().unwrap();
        t.insert(ADDED_USER_ID.into(), AMQPValue::Boolean(true));
        want = want.with_user_id("app".into()).with_headers(t);
    } else {
        assert_eq!(
            frames[1].2,
            h[7..h.len() - 1],
            "the header is sent as it came"
        );
    }
    assert_eq!(got.unwrap_or(sent.properties), want);
    match frames::method(&frames[0].2).unwrap() {
        AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => {
            assert_eq!(
                (p.routing_key.as_str(), p.mandatory, frames[0].1),
                ("rk", true, 5)
            );
            p.exchange.to_string()
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn only_a_positive_or_unreadable_x_delay_to_a_delayed_exchange_goes_to_the_ingress() {
    let ingress = "p.gw.x.orders";
    assert_eq!(
        publish_through("orders", Some(AMQPValue::LongInt(500))),
        ingress
    );
    assert_eq!(
        publish_through(
            "orders",
            Some(AMQPValue::LongString(LongString::from("1500")))
        ),
        ingress
    );
    // the gateway parks what it cannot read, with the reason
    assert_eq!(
        publish_through(
            "orders",
            Some(AMQPValue::LongString(LongString::from("abc")))
        ),
        ingress
    );
    assert_eq!(
        publish_through("orders", Some(AMQPValue::LongInt(99_999))),
        ingress
    );
    // as the plugin: no delay goes straight
    assert_eq!(
        publish_through("orders", Some(AMQPValue::LongInt(0))),
        "orders"
    );
    assert_eq!(
        publish_through("orders", Some(AMQPValue::LongInt(-20))),
        "orders"
    );
    assert_eq!(publish_through("orders", None), "orders");
    // not a delayed exchange: never held
    assert_eq!(
        publish_through("other", Some(AMQPValue::LongInt(500))),
        "other"
    );
}

fn delayed_declare(args: FieldTable, passive: bool, nowait: bool) -> Step {
    let m = encode(AMQPFrame::Method(
        2,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "orders".into(),
            kind: DELAYED_TYPE.into(),
            passive,
            durable: true,
            nowait,
            arguments: args,
            ..Default::default()
        })),
    ));
    with_raw(&m, |r| client().frame(r, &seen(&Pairs::default(), 1))).unwrap()
}

#[test]
fn a_delayed_declare_becomes_a_declare_of_its_real_type() {
    let mut args = FieldTable::default();
    args.insert(
        DELAYED_TYPE_ARG.into(),
        AMQPValue::LongString(LongString::from("topic")),
    );
    args.insert(
        "alternate-exchange".into(),
        AMQPValue::LongString(LongString::from("ae")),
    );
    let Step::Declare(d) = delayed_declare(args.clone(), false, true) else {
        panic!("not rewritten")
    };
    assert_eq!(
        (d.channel, d.exchange.as_str(), d.nowait),
        (2, "orders", true)
    );
    let frames = frames_of(&d.bytes);
    let AMQPClass::Exchange(exchange::AMQPMethod::Declare(got)) =
        frames::method(&frames[0].2).unwrap()
    else {
        panic!("not a declare")
    };
    assert_eq!(got.kind.as_str(), "topic");
    assert!(
        got.durable && !got.nowait,
        "the broker always answers the proxy"
    );
    assert!(got.arguments.inner().get(DELAYED_TYPE_ARG).is_none());
    assert!(got.arguments.inner().get("alternate-exchange").is_some());

    assert_eq!(
        delayed_declare(args, true, false),
        Step::Lookup("orders".into())
    );
    // without a real type, the broker refuses it, as the plugin does
    assert_eq!(
        delayed_declare(FieldTable::default(), false, false),
        Step::Pass
    );
    let mut bad = FieldTable::default();
    bad.insert(DELAYED_TYPE_ARG.into(), AMQPValue::LongInt(3));
    assert_eq!(delayed_declare(bad, false, false), Step::Pass);
}

fn delete_of(exchange: &str, nowait: bool) -> Vec<u8> {
    encode(AMQPFrame::Method(
        4,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: exchange.into(),
            if_unused: true,
            nowait,
        })),
    ))
}

#[test]
fn a_delete_of_a_delayed_exchange_asks_for_the_brokers_answer_and_others_pass() {
    let (mut side, pairs) = (client(), pairs());
    let plain = delete_of("other", true);
    let step = with_raw(&plain, |r| side.frame(r, &seen(&pairs, 1))).unwrap();
    assert_eq!(step, Step::Pass, "not a delayed exchange");
    let delayed = delete_of("orders", true);
    let Step::Delete(d) = with_raw(&delayed, |r| side.frame(r, &seen(&pairs, 1))).unwrap() else {
        panic!("not rewritten")
    };
    assert_eq!(
        (d.channel, d.exchange.as_str(), d.nowait),
        (4, "orders", true)
    );
    let frames = frames_of(&d.bytes);
    let AMQPClass::Exchange(exchange::AMQPMethod::Delete(got)) =
        frames::method(&frames[0].2).unwrap()
    else {
        panic!("not a delete")
    };
    assert!(got.if_unused && !got.nowait, "{got:?}");
    let ok = encode(AMQPFrame::Method(
        4,
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
    ));
    assert_eq!(
        with_raw(&ok, |r| server_frame(r, &pairs, true, CAP)).unwrap(),
        Step::DeleteOk(4)
    );
    let p = pairs;
    assert!(p.remove("orders") && !p.remove("orders"));
    assert!(p.is_empty() && p.exchange_of("p.gw.x.orders").is_none());
}

#[test]
fn a_return_from_an_ingress_names_the_application_exchange() {
    let ret = |x: &str| {
        encode(AMQPFrame::Method(
            4,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: 312,
                reply_text: "NO_ROUTE".into(),
                exchange: x.into(),
                routing_key: "rk".into(),
            })),
        ))
    };
    let pairs = pairs();
    let Step::Bytes(b) = with_raw(&ret("p.gw.x.orders"), |r| {
        server_frame(r, &pairs, true, CAP)
    })
    .unwrap() else {
        panic!("not rewritten")
    };
    assert_eq!(b, ret("orders"));
    assert_eq!(
        with_raw(&ret("orders"), |r| server_frame(r, &pairs, true, CAP)).unwrap(),
        Step::Pass
    );
    let ok = encode(AMQPFrame::Method(
        7,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    ));
    assert_eq!(
        with_raw(&ok, |r| server_frame(r, &pairs, true, CAP)).unwrap(),
        Step::DeclareOk(7)
    );
    let body = encode(AMQPFrame::Body(7, b"p.gw.x.orders".to_vec()));
    assert_eq!(
        with_raw(&body, |r| server_frame(r, &pairs, true, CAP)).unwrap(),
        Step::Pass
    );
}

fn tune(frame_max: u32, channel_max: u16) -> Vec<u8> {
    encode(AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
            channel_max,
            frame_max,
            heartbeat: 60,
        })),
    ))
}

fn tune_ok(frame_max: u32, channel_max: u16) -> Vec<u8> {
    encode(AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max,
            frame_max,
            heartbeat: 30,
        })),
    ))
}

#[test]
fn frame_max_is_never_above_the_brokers_the_clients_or_the_cap() {
    // the broker's tune is offered within the cap (its 0, unlimited, becomes the cap)
    for (broker, offered) in [(1 << 20, CAP), (0, CAP), (65_536, 65_536)] {
        let Step::Tuned(offer, bytes) = with_raw(&tune(broker, 0), |r| {
            server_frame(r, &Pairs::default(), false, CAP)
        })
        .unwrap() else {
            panic!("the tune is the proxy's offer")
        };
        assert_eq!(offer, Offer::of(offered, MAX_CHANNELS, CAP));
        assert_eq!(bytes, tune(offered, MAX_CHANNELS));
    }
    // the client's tune-ok: what it asks within the offer; 0 and more become the offer
    let (offer, none) = (Offer::of(CAP, 100, CAP), Pairs::default());
    let tuned = Seen {
        offered: Some(offer),
        ..seen(&none, 1)
    };
    for (asked, agreed) in [
        ((65_536, 10), (65_536, 10)),
        ((0, 0), (CAP, 100)),
        ((0xFFFF_FFF0, 2047), (CAP, 100)),
    ] {
        let mut side = ClientSide::new("/");
        let frame = tune_ok(asked.0, asked.1);
        let step = with_raw(&frame, |r| side.frame(r, &tuned)).unwrap();
        assert_eq!(
            (side.frame_max, side.channel_max),
            (Some(agreed.0), Some(agreed.1))
        );
        if asked == agreed {
            assert_eq!(step, Step::Pass);
        } else {
            assert_eq!(step, Step::Bytes(tune_ok(agreed.0, agreed.1)));
        }
    }
    // a tune-ok before the broker's tune (a forged one): the handshake's size at most
    let mut side = ClientSide::new("/");
    let early = Seen {
        offered: None,
        ..seen(&none, 1)
    };
    with_raw(&tune_ok(0xFFFF_FFF0, 0), |r| side.frame(r, &early)).unwrap();
    assert_eq!(side.frame_max, Some(HANDSHAKE_FRAME_MAX));
}

#[test]
fn closes_are_well_formed_and_garbage_is_an_error() {
    let close = close_connection(541, &"x".repeat(500)).unwrap();
    let frames = frames_of(&close);
    assert!(matches!(
        frames::method(&frames[0].2).unwrap(),
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) if c.reply_code == 541 && c.reply_text.as_str().len() == 200
    ));
    // a text of several-byte characters stays within a short string
    let close = close_connection(541, &"é".repeat(300)).unwrap();
    assert!(frames::method(&frames_of(&close)[0].2).is_ok());
    // a method frame that does not parse is an error, not a panic
    let mut bad = publish("orders");
    bad[13] = 0xff; // the exchange name's length, past the payload
    assert!(with_raw(&bad, |r| client().frame(r, &seen(&pairs(), 1))).is_err());
}

fn start_ok(mechanism: &str, response: &[u8]) -> Vec<u8> {
    encode(AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: mechanism.into(),
            response: response.to_vec().into(),
            locale: "en_US".into(),
        })),
    ))
}

fn open(vhost: &str) -> Vec<u8> {
    encode(AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: vhost.into(),
        })),
    ))
}

#[test]
fn the_handshake_names_the_user_and_the_virtual_host() {
    let pairs = Pairs::default();
    let mut side = ClientSide::new("/");
    let plain = start_ok("PLAIN", b"\0app-a\0s3cret");
    assert_eq!(
        with_raw(&plain, |r| side.frame(r, &seen(&pairs, 1))).unwrap(),
        Step::Pass
    );
    assert_eq!(side.user.as_deref(), Some("app-a"));
    assert!(
        !format!("{side:?}").contains("s3cret"),
        "the password is not kept"
    );
    assert!(!side.acts(), "not before connection.open");
    with_raw(&open("/"), |r| side.frame(r, &seen(&pairs, 1))).unwrap();
    assert!(side.acts());
    let mut other = ClientSide::new("/");
    with_raw(&start_ok("EXTERNAL", b""), |r| {
        other.frame(r, &seen(&pairs, 1))
    })
    .unwrap();
    with_raw(&open("apps"), |r| other.frame(r, &seen(&pairs, 1))).unwrap();
    assert_eq!(
        (
            other.user.as_deref(),
            other.mechanism.as_str(),
            other.acts()
        ),
        (None, "EXTERNAL", false)
    );
}

#[test]
fn in_another_virtual_host_everything_passes_as_it_came() {
    let pairs = pairs();
    let mut side = client();
    side.vhost = Some("apps".into());
    let mut args = FieldTable::default();
    args.insert(
        DELAYED_TYPE_ARG.into(),
        AMQPValue::LongString(LongString::from("direct")),
    );
    let declare = encode(AMQPFrame::Method(
        2,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "orders".into(),
            kind: DELAYED_TYPE.into(),
            arguments: args,
            ..Default::default()
        })),
    ));
    for frame in [declare, delete_of("orders", false), publish("orders")] {
        let step = with_raw(&frame, |r| side.frame(r, &seen(&pairs, 10_000))).unwrap();
        assert_eq!(step, Step::Pass);
    }
    assert_eq!(side.held(), 0);
    let ret = encode(AMQPFrame::Method(
        4,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
            exchange: "p.gw.x.orders".into(),
            routing_key: "rk".into(),
        })),
    ));
    let step = with_raw(&ret, |r| server_frame(r, &pairs, false, CAP)).unwrap();
    assert_eq!(step, Step::Pass, "that vhost's own exchange of the name");
}

#[test]
fn a_publish_is_held_only_on_an_open_channel() {
    let (pairs, mut side) = (pairs(), client());
    let closed = Seen {
        open: false,
        ..seen(&pairs, 10_000)
    };
    let m = publish("orders");
    assert_eq!(
        with_raw(&m, |r| side.frame(r, &closed)).unwrap(),
        Step::Pass
    );
    assert_eq!(side.held(), 0);
}

#[test]
fn the_user_id_is_the_clients_unless_it_set_one_or_it_would_not_fit() {
    let pairs = pairs();
    let delayed = || {
        let mut h = FieldTable::default();
        h.insert(X_DELAY.into(), AMQPValue::LongInt(500));
        BasicProperties::default().with_headers(h)
    };
    let header_of = |p: BasicProperties| {
        encode(AMQPFrame::Header(
            5,
            AMQPContentHeader {
                class_id: 60,
                body_size: 3,
                properties: p,
            },
        ))
    };
    let through = |side: &mut ClientSide, h: &[u8]| {
        let m = publish("orders");
        assert_eq!(
            with_raw(&m, |r| side.frame(r, &seen(&pairs, 10_000))).unwrap(),
            Step::Held
        );
        let Step::Bytes(out) = with_raw(h, |r| side.frame(r, &seen(&pairs, 10_000))).unwrap()
        else {
            panic!("released")
        };
        frames_of(&out)[1].2.clone()
    };
    // none set: the client's user, marked as the proxy's
    let sent = through(&mut client(), &header_of(delayed()));
    let got = frames::content_header(&sent).unwrap().properties;
    assert_eq!(got.user_id().as_ref().map(|u| u.as_str()), Some("app"));
    let added = got
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get(ADDED_USER_ID)
        .cloned();
    assert_eq!(added, Some(AMQPValue::Boolean(true)));
    // the client's own (the broker checks it), an unknown user: only stamped
    let header_props = |f: &[u8]| frames::content_header(f).unwrap().properties;
    let own = delayed().with_user_id("app".into());
    let sent = through(&mut client(), &header_of(own.clone()));
    assert_eq!(unstamped(&header_props(&sent)), Some(own));
    let mut unknown = client();
    unknown.user = None;
    let plain = header_of(delayed());
    let sent = through(&mut unknown, &plain);
    assert_eq!(unstamped(&header_props(&sent)), Some(delayed()));
    // a frame too long: as it came
    let mut small = client();
    small.frame_max = Some(plain.len() as u32);
    assert_eq!(through(&mut small, &plain), plain[7..plain.len() - 1]);
}

#[test]
fn requests_that_ask_for_an_answer_are_named() {
    let declare = |passive, nowait| {
        encode(AMQPFrame::Method(
            1,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: "amq.direct".into(),
                kind: "direct".into(),
                passive,
                nowait,
                ..Default::default()
            })),
        ))
    };
    let request_of = |f: &[u8]| with_raw(f, request).unwrap();
    assert_eq!(
        request_of(&declare(true, false)),
        Some(Request::Asks(Ask::Declare))
    );
    assert_eq!(
        request_of(&declare(false, false)),
        Some(Request::Asks(Ask::Declare))
    );
    assert_eq!(request_of(&declare(true, true)), None);
    assert_eq!(
        request_of(&delete_of("x", false)),
        Some(Request::Asks(Ask::Delete))
    );
    assert_eq!(request_of(&delete_of("x", true)), None);
    let ch = |m| encode(AMQPFrame::Method(3, AMQPClass::Channel(m)));
    let open = ch(channel::AMQPMethod::Open(channel::Open {}));
    let close = ch(channel::AMQPMethod::Close(Default::default()));
    assert_eq!(request_of(&open), Some(Request::Open));
    assert_eq!(request_of(&close), Some(Request::Close));
    assert_eq!(request_of(&publish("x")), None);
}

#[test]
fn the_parsed_methods_are_the_ones_named_and_others_pass_unparsed() {
    let ids = |m: AMQPClass| (m.get_amqp_class_id(), m.get_amqp_method_id());
    let c = |m| ids(AMQPClass::Connection(m));
    let publish_m = AMQPClass::Basic(basic::AMQPMethod::Publish(Default::default()));
    let declare = AMQPClass::Exchange(exchange::AMQPMethod::Declare(Default::default()));
    let delete = AMQPClass::Exchange(exchange::AMQPMethod::Delete(Default::default()));
    assert_eq!(
        CLIENT_METHODS,
        [
            ids(publish_m),
            ids(declare.clone()),
            ids(delete.clone()),
            c(connection::AMQPMethod::TuneOk(Default::default())),
            c(connection::AMQPMethod::StartOk(Default::default())),
            c(connection::AMQPMethod::Open(Default::default())),
        ]
    );
    let ch = |m| ids(AMQPClass::Channel(m));
    assert_eq!(
        CHANNEL_METHODS,
        [
            ch(channel::AMQPMethod::Open(Default::default())),
            ch(channel::AMQPMethod::Close(Default::default()))
        ]
    );
    assert_eq!(ASKING_METHODS, [ids(declare), ids(delete)]);
    let ret = AMQPClass::Basic(basic::AMQPMethod::Return(Default::default()));
    let ok = AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(Default::default()));
    let delete_ok = AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(Default::default()));
    assert_eq!(
        SERVER_METHODS,
        [
            ids(ret),
            ids(ok),
            ids(delete_ok),
            ch(channel::AMQPMethod::Close(Default::default())),
            c(connection::AMQPMethod::Close(Default::default())),
            c(connection::AMQPMethod::OpenOk(Default::default())),
            c(connection::AMQPMethod::Tune(Default::default())),
            ch(channel::AMQPMethod::OpenOk(Default::default())),
        ]
    );
    // a method amq-protocol does not know (a broker extension) passes as it came
    let mut unknown = publish("orders");
    unknown[7..11].copy_from_slice(&[0x0f, 0xff, 0, 1]);
    assert_eq!(
        with_raw(&unknown, |r| server_frame(r, &pairs(), true, CAP)).unwrap(),
        Step::Pass
    );
    let mut side = client();
    assert_eq!(
        with_raw(&unknown, |r| side.frame(r, &seen(&pairs(), 1))).unwrap(),
        Step::Pass
    );
}
