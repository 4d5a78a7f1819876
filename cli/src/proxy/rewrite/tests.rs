use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::LongString;

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
    assert!(p.insert("orders", "p.gw.x.orders"));
    assert!(!p.insert("orders", "p.gw.x.orders"));
    p
}

/// What a publish to `exchange` followed by its header becomes: the exchange it goes to, and
/// whether the header frame is the one sent.
fn publish_through(exchange: &str, x_delay: Option<AMQPValue>) -> String {
    let (pairs, mut side) = (pairs(), ClientSide::default());
    let m = publish(exchange);
    let first = with_raw(&m, |r| side.frame(r, &pairs, 10_000)).unwrap();
    if first == Step::Pass {
        return exchange.to_string();
    }
    assert_eq!(first, Step::Held);
    let h = header(x_delay);
    let Step::Bytes(out) = with_raw(&h, |r| side.frame(r, &pairs, 10_000)).unwrap() else {
        panic!("the header releases the publish")
    };
    let frames = frames_of(&out);
    assert_eq!(frames.len(), 2);
    assert_eq!(
        frames[1].2,
        h[7..h.len() - 1],
        "the header is sent as it came"
    );
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
    with_raw(&m, |r| ClientSide::default().frame(r, &Pairs::default(), 1)).unwrap()
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
    let mut side = ClientSide::default();
    let plain = delete_of("other", true);
    let step = with_raw(&plain, |r| side.frame(r, &pairs(), 1)).unwrap();
    assert_eq!(step, Step::Pass, "not a delayed exchange");
    let delayed = delete_of("orders", true);
    let Step::Delete(d) = with_raw(&delayed, |r| side.frame(r, &pairs(), 1)).unwrap() else {
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
        with_raw(&ok, |r| server_frame(r, &pairs())).unwrap(),
        Step::DeleteOk(4)
    );
    let p = pairs();
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
    let Step::Bytes(b) = with_raw(&ret("p.gw.x.orders"), |r| server_frame(r, &pairs)).unwrap()
    else {
        panic!("not rewritten")
    };
    assert_eq!(b, ret("orders"));
    assert_eq!(
        with_raw(&ret("orders"), |r| server_frame(r, &pairs)).unwrap(),
        Step::Pass
    );
    let ok = encode(AMQPFrame::Method(
        7,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    ));
    assert_eq!(
        with_raw(&ok, |r| server_frame(r, &pairs)).unwrap(),
        Step::DeclareOk(7)
    );
    let body = encode(AMQPFrame::Body(7, b"p.gw.x.orders".to_vec()));
    assert_eq!(
        with_raw(&body, |r| server_frame(r, &pairs)).unwrap(),
        Step::Pass
    );
}

#[test]
fn tune_ok_gives_the_frame_max_and_closes_are_well_formed() {
    let mut side = ClientSide::default();
    let tune = encode(AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 10,
            frame_max: 65_536,
            heartbeat: 30,
        })),
    ));
    assert_eq!(
        with_raw(&tune, |r| side.frame(r, &Pairs::default(), 1)).unwrap(),
        Step::Pass
    );
    assert_eq!(side.frame_max, Some(65_536));
    let close = close_connection(541, &"x".repeat(500)).unwrap();
    let frames = frames_of(&close);
    assert!(matches!(
        frames::method(&frames[0].2).unwrap(),
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) if c.reply_code == 541 && c.reply_text.as_str().len() == 200
    ));
    // a method frame that does not parse is an error, not a panic
    let mut bad = publish("orders");
    bad[13] = 0xff; // the exchange name's length, past the payload
    assert!(with_raw(&bad, |r| side.frame(r, &pairs(), 1)).is_err());
}

#[test]
fn the_parsed_methods_are_the_ones_named_and_others_pass_unparsed() {
    let ids = |m: AMQPClass| (m.get_amqp_class_id(), m.get_amqp_method_id());
    let publish_m = AMQPClass::Basic(basic::AMQPMethod::Publish(Default::default()));
    let declare = AMQPClass::Exchange(exchange::AMQPMethod::Declare(Default::default()));
    let delete = AMQPClass::Exchange(exchange::AMQPMethod::Delete(Default::default()));
    let tune_ok = AMQPClass::Connection(connection::AMQPMethod::TuneOk(Default::default()));
    assert_eq!(
        CLIENT_METHODS,
        [ids(publish_m), ids(declare), ids(delete), ids(tune_ok)]
    );
    let ret = AMQPClass::Basic(basic::AMQPMethod::Return(Default::default()));
    let ok = AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(Default::default()));
    let delete_ok = AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(Default::default()));
    let ch_close = AMQPClass::Channel(channel::AMQPMethod::Close(Default::default()));
    let close = AMQPClass::Connection(connection::AMQPMethod::Close(Default::default()));
    let open_ok = AMQPClass::Connection(connection::AMQPMethod::OpenOk(Default::default()));
    assert_eq!(
        SERVER_METHODS,
        [
            ids(ret),
            ids(ok),
            ids(delete_ok),
            ids(ch_close),
            ids(close),
            ids(open_ok)
        ]
    );
    // a method amq-protocol does not know (a broker extension) passes as it came
    let mut unknown = publish("orders");
    unknown[7..11].copy_from_slice(&[0x0f, 0xff, 0, 1]);
    assert_eq!(
        with_raw(&unknown, |r| server_frame(r, &pairs())).unwrap(),
        Step::Pass
    );
    let mut side = ClientSide::default();
    assert_eq!(
        with_raw(&unknown, |r| side.frame(r, &pairs(), 1)).unwrap(),
        Step::Pass
    );
}
