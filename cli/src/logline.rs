//! Human log lines that a value from outside cannot forge: every control character of the
//! message and of each field is escaped ([`escape_controls`], [`EscapedFields`]).

use amqp_delay::error_chain as chain;

/// Writes what passes through it to `0` with every control character escaped (see
/// [`escape_controls`]).
struct Escaping<'a>(&'a mut dyn std::fmt::Write);

impl std::fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let mut rest = s;
        while let Some(i) = rest.find(char::is_control) {
            self.0.write_str(&rest[..i])?;
            let mut tail = rest[i..].chars();
            match tail.next() {
                Some('\n') => self.0.write_str("\\n")?,
                Some('\r') => self.0.write_str("\\r")?,
                Some('\t') => self.0.write_str("\\t")?,
                Some(c) => write!(self.0, "\\u{{{:x}}}", u32::from(c))?,
                None => break,
            }
            rest = tail.as_str();
        }
        self.0.write_str(rest)
    }
}

/// `s` with its control characters escaped: newline, carriage return and tab as `\n`, `\r`,
/// `\t`, the others (the rest of C0 with ESC, DEL, C1) as `\u{1b}`. A value from outside (a
/// message id, a header, a broker's reply) written into a line of text then can neither end the
/// line (and forge the next one) nor drive the reader's terminal.
pub fn escape_controls(s: &str) -> std::borrow::Cow<'_, str> {
    use std::fmt::Write as _;
    if !s.contains(char::is_control) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len() + 8);
    let _ = Escaping(&mut out).write_str(s);
    out.into()
}

/// The fields of a human log line as tracing-subscriber writes them (the message, then
/// `name=value`, colour on a terminal), with every control character of the message and of
/// each value escaped ([`escape_controls`]). tracing-subscriber 0.3.23 escapes ESC, BEL, BS,
/// FF, DEL and C1 in the message only: a newline anywhere, or an ESC in a `%value`, went out
/// raw, so an id holding a newline could forge a log line.
#[derive(Debug, Clone, Copy, Default)]
pub struct EscapedFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for EscapedFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut v = FieldWriter {
            writer: &mut writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

/// Writes the fields of one event or span for [`EscapedFields`].
struct FieldWriter<'a, 'w> {
    writer: &'a mut tracing_subscriber::fmt::format::Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl FieldWriter<'_, '_> {
    fn field(&mut self, name: &str, value: &dyn std::fmt::Debug) -> std::fmt::Result {
        use std::fmt::Write as _;
        if !std::mem::take(&mut self.first) {
            self.writer.write_char(' ')?;
        }
        if name != "message" {
            if self.writer.has_ansi_escapes() {
                // italic name, dimmed '=', as tracing-subscriber's own
                write!(self.writer, "\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m")?;
            } else {
                write!(self.writer, "{name}=")?;
            }
        }
        write!(Escaping(&mut *self.writer), "{value:?}")
    }
}

impl tracing::field::Visit for FieldWriter<'_, '_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"))
        } else {
            self.record_debug(field, &value)
        }
    }

    fn record_error(
        &mut self,
        field: &tracing::field::Field,
        value: &(dyn std::error::Error + 'static),
    ) {
        self.record_debug(field, &format_args!("{}", chain(value)))
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let name = field.name();
        // `log` records' metadata, which the line shows already
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        self.result = self.field(name.strip_prefix("r#").unwrap_or(name), value);
    }
}

/// The layer of human log lines, to `writer` (colour when `ansi`): tracing-subscriber's own
/// format with [`EscapedFields`].
pub fn human_layer<S, W>(
    writer: W,
    ansi: bool,
) -> tracing_subscriber::fmt::Layer<S, EscapedFields, tracing_subscriber::fmt::format::Format, W>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + 'static,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(EscapedFields)
        .with_writer(writer)
        .with_ansi(ansi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert!(matches!(
            escape_controls("plain id, ünïcode ✓"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            escape_controls("a\nb\rc\td\x1b[2Je\x07\x00\x7f\u{85}\u{9b}f"),
            r"a\nb\rc\td\u{1b}[2Je\u{7}\u{0}\u{7f}\u{85}\u{9b}f"
        );
        assert_eq!(escape_controls("\n"), r"\n");
        // a backslash is not a control: a value spelling `\n` stays as it is
        assert_eq!(escape_controls(r"a\nb"), r"a\nb");
    }

    /// What a human log line says of an event whose message and every kind of field hold
    /// control characters: each escaped, one line.
    fn human_logged(ansi: bool) -> String {
        use tracing_subscriber::layer::SubscriberExt as _;
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber =
            tracing_subscriber::registry().with(human_layer(move || out.clone(), ansi));
        let id = "evil\nFORGED\x1b[31m";
        let err = std::io::Error::other("bad\nthing");
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("run", queue = %"q\nx");
            let _in = span.enter();
            tracing::warn!(id = %id, key = ?"k\r", text = "t\x07", error = &err as &dyn std::error::Error, "parked {}", "m\nX\u{9b}");
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn human_log_lines_escape_every_field_and_the_message() {
        let plain = human_logged(false);
        assert_eq!(plain.lines().count(), 1, "{plain}");
        for escaped in [
            r"parked m\nX\u{9b}",
            r"id=evil\nFORGED\u{1b}[31m",
            r#"key="k\r""#,
            r#"text="t\u{7}""#,
            r"error=bad\nthing",
            r"queue=q\nx",
        ] {
            assert!(plain.contains(escaped), "{escaped} in {plain}");
        }
        assert!(
            !plain.contains(['\x1b', '\r', '\x07', '\u{9b}']),
            "{plain:?}"
        );
        // colour on a terminal: the names are styled, the values still escaped
        let colour = human_logged(true);
        assert_eq!(colour.lines().count(), 1, "{colour}");
        assert!(
            colour.contains("\x1b[3mid\x1b[0m\x1b[2m=\x1b[0m"),
            "{colour:?}"
        );
        assert!(colour.contains(r"evil\nFORGED\u{1b}[31m"), "{colour:?}");
        assert!(!colour.contains("\x1b[31m"), "{colour:?}");
    }

    /// JSON log lines are escaped by serde: one line, and the value as it was.
    #[test]
    fn json_log_lines_keep_values_whole_on_one_line() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let out = buf.clone();
        let writer = move || Sink(out.clone());
        struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(writer)
                .json()
                .with_ansi(false),
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(id = %"evil\nFORGED\x1b[31m", "parked");
        });
        let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        let v: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(v["fields"]["id"], "evil\nFORGED\x1b[31m");
    }
}
