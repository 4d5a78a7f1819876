//! The binaries' command lines as deployment files write them, checked against the binaries'
//! own `--help` and clap's parser; settings loaded the way the binaries load them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use amqp_delay::Settings;

fn bin_path(name: &str) -> &'static str {
    match name {
        "delay-publisher" => env!("CARGO_BIN_EXE_delay-publisher"),
        "delay-consumer" => env!("CARGO_BIN_EXE_delay-consumer"),
        "delay-proxy" => env!("CARGO_BIN_EXE_delay-proxy"),
        "delay-console" => env!("CARGO_BIN_EXE_delay-console"),
        other => panic!(
            "'{other}' is not one of our binaries (delay-publisher, delay-consumer, delay-proxy, \
             delay-console)"
        ),
    }
}

/// Runs one of our binaries with `args`, in an empty environment (no AMQP_* variable can
/// change what it accepts); returns (exit code, stdout + stderr).
fn run_bin(name: &str, args: &[String]) -> (i32, String) {
    let out = Command::new(bin_path(name))
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// What `--help` of a binary (or of one of its subcommands) lists.
#[derive(Clone, Debug, Default)]
struct Help {
    /// `--long` flag → takes a value
    flags: HashMap<String, bool>,
    /// `-c` short flag → takes a value
    shorts: HashMap<String, bool>,
    subcommands: BTreeSet<String>,
}

fn help(bin: &str, sub: Option<&str>) -> Help {
    static CACHE: OnceLock<Mutex<HashMap<String, Help>>> = OnceLock::new();
    let key = format!("{bin} {}", sub.unwrap_or(""));
    let cache = CACHE.get_or_init(Default::default);
    if let Some(h) = cache.lock().unwrap().get(&key) {
        return h.clone();
    }
    // a nested subcommand is its path: "pending serve"
    let mut args: Vec<String> = sub
        .map(|s| s.split(' ').map(str::to_string).collect())
        .unwrap_or_default();
    args.push("--help".into());
    let (code, text) = run_bin(bin, &args);
    assert_eq!(code, 0, "{key} --help failed:\n{text}");
    let mut h = Help::default();
    let mut in_commands = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
            continue;
        }
        if in_commands {
            if line.trim().is_empty() || !line.starts_with("  ") {
                in_commands = false;
            } else if let Some(word) = line.split_whitespace().next() {
                h.subcommands.insert(word.to_string());
            }
            continue;
        }
        let t = line.trim_start();
        if !t.starts_with('-') {
            continue;
        }
        for part in t.split(", ") {
            let mut words = part.splitn(2, ' ');
            let flag = words.next().unwrap_or_default();
            let takes_value = words.next().is_some_and(|w| w.starts_with('<'));
            if let Some(long) = flag.strip_prefix("--") {
                h.flags.insert(long.to_string(), takes_value);
            } else if let Some(short) = flag.strip_prefix('-') {
                // "-c, --config <FILE>": the value is shown after the long form
                let takes = t.contains(" <");
                h.shorts.insert(short.to_string(), takes);
            }
        }
    }
    cache.lock().unwrap().insert(key, h.clone());
    h
}

/// One invocation of our binaries as written in a deployment file, parsed the way clap
/// parses it: the subcommand, and every flag with its value.
#[derive(Debug)]
pub(crate) struct Invocation {
    pub(crate) bin: String,
    pub(crate) sub: Option<String>,
    flags: Vec<(String, Option<String>)>,
}

impl Invocation {
    pub(crate) fn value(&self, flag: &str) -> Option<&str> {
        self.flags
            .iter()
            .find(|(f, _)| f == flag)
            .and_then(|(_, v)| v.as_deref())
    }
    pub(crate) fn values(&self, flag: &str) -> Vec<&str> {
        self.flags
            .iter()
            .filter(|(f, _)| f == flag)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }
    pub(crate) fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|(f, _)| f == flag)
    }
}

/// Checks `argv` (`delay-publisher ...` or `delay-consumer ...`): the binary exists, the
/// subcommand is one its `--help` lists, every flag is one that the (sub)command's `--help`
/// lists, flags that take a value have one; then clap itself parses the very same arguments
/// (with `--help` appended, so nothing connects anywhere): a value clap refuses (a bad
/// `--log-format`, a malformed `--delay`) fails here.
pub(crate) fn check_invocation(argv: &[String], what: &str) -> Invocation {
    let bin = argv
        .first()
        .unwrap_or_else(|| panic!("{what}: empty command"));
    let top = help(bin, None);
    let mut inv = Invocation {
        bin: bin.clone(),
        sub: None,
        flags: Vec::new(),
    };
    let mut current = top.clone();
    let mut i = 1;
    while i < argv.len() {
        let a = &argv[i];
        if let Some(long) = a.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (long.to_string(), None),
            };
            let takes = *current.flags.get(&name).unwrap_or_else(|| {
                panic!(
                    "{what}: `{}` has no flag --{name} (its --help lists: {:?})",
                    [bin.as_str(), inv.sub.as_deref().unwrap_or("")].join(" "),
                    current.flags.keys().collect::<BTreeSet<_>>()
                )
            });
            let value = if takes && inline.is_none() {
                i += 1;
                Some(
                    argv.get(i)
                        .unwrap_or_else(|| panic!("{what}: --{name} needs a value"))
                        .clone(),
                )
            } else {
                assert!(takes || inline.is_none(), "{what}: --{name} takes no value");
                inline
            };
            inv.flags.push((name, value));
        } else if a.starts_with('-') && a.len() == 2 {
            let short = &a[1..];
            let takes = *current
                .shorts
                .get(short)
                .unwrap_or_else(|| panic!("{what}: `{bin}` has no flag {a}"));
            let value = if takes {
                i += 1;
                argv.get(i).cloned()
            } else {
                None
            };
            let long = match short {
                "c" => "config",
                "q" => "queue",
                other => other,
            };
            inv.flags.push((long.to_string(), value));
        } else if !current.subcommands.is_empty() {
            assert!(
                current.subcommands.contains(a),
                "{what}: `{bin} {}` has no subcommand '{a}' (it has {:?})",
                inv.sub.as_deref().unwrap_or(""),
                current.subcommands
            );
            let path = match &inv.sub {
                Some(s) => format!("{s} {a}"),
                None => a.clone(),
            };
            current = help(bin, Some(&path));
            inv.sub = Some(path);
        } else {
            panic!("{what}: unexpected argument '{a}' for `{bin}`");
        }
        i += 1;
    }
    assert!(
        current.subcommands.is_empty(),
        "{what}: `{bin} {}` needs a subcommand",
        inv.sub.as_deref().unwrap_or("")
    );
    let mut args = argv[1..].to_vec();
    args.push("--help".into());
    let (code, text) = run_bin(bin, &args);
    assert_eq!(
        code, 0,
        "{what}: clap refuses {argv:?} (run with --help appended):\n{text}"
    );
    inv
}

/// The invocations of our binaries inside a `sh -c` script of a compose file (`$$` is
/// Compose's escape for a literal `$`).
pub(crate) fn script_invocations(script: &str, what: &str) -> Vec<Invocation> {
    let script = script.replace("$$", "$");
    let mut out = Vec::new();
    for line in script.lines() {
        for start in ["delay-publisher", "delay-consumer"] {
            let mut rest = line;
            while let Some(at) = rest.find(start) {
                let tail = &rest[at..];
                let end = tail.find(['|', ';', '&', ')']).unwrap_or(tail.len());
                let words = shell_words::split(&tail[..end])
                    .unwrap_or_else(|e| panic!("{what}: cannot split '{}': {e}", &tail[..end]));
                out.push(check_invocation(&words, what));
                rest = &tail[end..];
            }
        }
    }
    out
}

/// `0.0.0.0:9464` → 9464.
pub(crate) fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("'{addr}' is not HOST:PORT"))
}

// --- exit codes ----------------------------------------------------------------------------------

/// A binary's exit code follows the kind of its error (`cli::exit_code`), seen without a
/// broker: 2 when the command or its settings must change, 1 when the broker cannot be
/// reached.
#[test]
fn the_exit_code_follows_the_kind_of_error() {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let nobody = "amqp://guest:guest@127.0.0.1:1/%2f";
    // the request: a header that is none (checked before anything connects)
    let (code, text) = run_bin(
        "delay-publisher",
        &args(&[
            "--url", nobody, "send", "--queue", "q", "--delay", "1s", "--body", "x", "--header",
            "nameless",
        ]),
    );
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("invalid request: --header 'nameless' is not NAME=VALUE"),
        "{text}"
    );
    // the broker's native delay header is refused on `send` like our own (before connecting)
    let (code, text) = run_bin(
        "delay-publisher",
        &args(&[
            "--url",
            nobody,
            "send",
            "--queue",
            "q",
            "--delay",
            "1s",
            "--body",
            "x",
            "--header",
            "x-opt-delivery-time=1900000000000",
        ]),
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("'x-opt-delivery-time' is reserved"), "{text}");
    // the configuration: a metrics address that is none (found after the settings loaded)
    let (code, text) = run_bin(
        "delay-consumer",
        &args(&[
            "--url",
            nobody,
            "--metrics-addr",
            "not-an-address",
            "--queue",
            "q",
            "--log",
        ]),
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("not-an-address"), "{text}");
    // the broker: nothing listens there (refused at once, or our connect timeout)
    let (code, text) = run_bin("delay-publisher", &args(&["--url", nobody, "declare"]));
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("cannot connect") || text.contains("no answer from the broker"),
        "{text}"
    );
}

// --- settings ------------------------------------------------------------------------------------

/// Loads settings the way the binaries do, from the optional TOML file and exactly the
/// `AMQP_DELAY_*` variables given (unknown keys are errors); AMQP_URL is checked as the URL list.
pub(crate) fn load_settings(
    toml: Option<&Path>,
    env: &BTreeMap<String, String>,
    what: &str,
) -> Settings {
    let mut map = HashMap::new();
    for (k, v) in env {
        if k == "AMQP_URL" {
            amqp_delay::ops::connection::validate_urls(v)
                .unwrap_or_else(|e| panic!("{what}: AMQP_URL: {e}"));
            continue;
        }
        assert!(
            k.starts_with("AMQP_DELAY_"),
            "{what}: {k} is not a variable amqp-delay reads"
        );
        map.insert(k.clone(), v.clone());
    }
    let mut s = Settings::load_with_env(toml, Some(map))
        .unwrap_or_else(|e| panic!("{what}: the settings do not load: {e}"));
    if let Some(u) = env.get("AMQP_URL") {
        s.url = u.clone();
    }
    s
}
