//! The README's quick start "by hand", run as written against the broker on 127.0.0.1:5672 with
//! a prefix of its own (`AMQP_DELAY_PREFIX`, which the README names): declare, send, and the
//! consumer, in the foreground, running `./cancel-order` (the user's program: here one that
//! notes what it was given) when the message is due. The one line not run is
//! `cargo install --path cli`: the test built the tools and put them first on PATH.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use amqp_delay::time::{now_ms, parse_duration_ms};

use crate::markdown;
use crate::shell::{Running, Session, tail};

const INSTALL: &str = "cargo install --path cli";

/// The user's program: what it was run for, when, and the body it read.
const CANCEL_ORDER: &str = "#!/bin/sh\n\
printf '%s %s %s ' \"$DELAY_MESSAGE_ID\" \"$DELAY_DUE_AT\" \"$(date +%s%3N)\" >>fired\n\
cat >>fired\necho >>fired\n";

/// Tears down what the quick start declared under its prefix, however the test ends.
struct Teardown {
    dir: std::path::PathBuf,
    env: Vec<(String, String)>,
    queue: String,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        // the destination queue (with its parking queue), then the tiers
        for args in [vec!["--queue", self.queue.as_str()], vec![]] {
            let out = std::process::Command::new(self.dir.join("bin").join("delay-publisher"))
                .arg("teardown")
                .args(args)
                .arg("--force")
                .current_dir(&self.dir)
                .env_clear()
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .output();
            match out {
                Ok(o) if !o.status.success() => {
                    eprintln!(
                        "[runbooks] teardown: {}",
                        String::from_utf8_lossy(&o.stderr)
                    )
                }
                Err(e) => eprintln!("[runbooks] teardown: {e}"),
                Ok(_) => {}
            }
        }
    }
}

/// The value of `--flag` in `code`.
fn flag<'a>(code: &'a str, flag: &str) -> &'a str {
    let mut words = code.split_whitespace();
    words.find(|w| *w == flag);
    words
        .next()
        .unwrap_or_else(|| panic!("the quick start has no {flag}"))
}

/// The "By hand" block without its `cargo install` line.
fn by_hand() -> String {
    let readme = crate::read_doc("README.md");
    let blocks = markdown::sh_blocks(&readme, "Quick start").unwrap();
    let block = blocks
        .iter()
        .find(|b| b.prose.contains("By hand"))
        .expect("the README's quick start has no block \"By hand\"");
    let code: String = block
        .code
        .lines()
        .filter(|l| !l.starts_with(INSTALL))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        code.lines().count() + 1,
        block.code.lines().count(),
        "the quick start has no line `{INSTALL}` to skip: {}",
        block.code
    );
    code
}

/// Waits until the program ran (and 2 s more, for a second run to show), the block ended by
/// itself (its status) or `deadline` passed.
fn wait_for_the_program(
    running: &mut Running,
    fired: &Path,
    deadline: Instant,
) -> Option<ExitStatus> {
    loop {
        if std::fs::read_to_string(fired).is_ok_and(|t| t.ends_with('\n')) {
            std::thread::sleep(Duration::from_secs(2));
            return None;
        }
        if let Some(status) = running.child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The block's output, for a failure.
fn said(running: &Running) -> String {
    let read = |p: &Path| tail(&std::fs::read_to_string(p).unwrap_or_default(), 30);
    format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        read(&running.stdout),
        read(&running.stderr)
    )
}

#[test]
fn the_readme_quick_start_by_hand_runs_the_message_once_when_it_is_due() {
    crate::machine_lock();
    let t0 = Instant::now();
    let code = by_hand();
    let delay = parse_duration_ms(flag(&code, "--delay")).expect("the quick start's --delay");
    let dir = crate::workdir("quick-start");
    let program = dir.join("cancel-order");
    std::fs::write(&program, CANCEL_ORDER).unwrap();
    std::fs::set_permissions(&program, PermissionsExt::from_mode(0o700)).unwrap();
    let mut env = crate::base_env(&dir);
    env.push((
        "AMQP_DELAY_PREFIX".into(),
        format!("rbq{:08x}", rand::random::<u32>()),
    ));
    let teardown = Teardown {
        dir: dir.clone(),
        env: env.clone(),
        queue: flag(&code, "--queue").to_string(),
    };
    let mut session = Session::new(&dir, env);
    let before = now_ms();
    let mut running = session.start("the README's quick start", &code);
    let fired = dir.join("fired");
    // the consumer runs until stopped
    let deadline = Instant::now() + Duration::from_millis(delay) + Duration::from_secs(120);
    let ended = wait_for_the_program(&mut running, &fired, deadline);
    let stubborn = session.stop_all(Duration::from_secs(30));
    let _ = running.child.wait();
    let said = said(&running);
    assert!(
        ended.is_none(),
        "the quick start ended by itself ({ended:?}):\n{code}\n{said}"
    );
    let text = std::fs::read_to_string(&fired).unwrap_or_default();
    // id, due (ms), ran at (ms), body; a message of an earlier run was due before `before`
    let runs: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.splitn(4, ' ').collect::<Vec<&str>>())
        .filter(|f| f.len() == 4 && f[1].parse::<u64>().is_ok_and(|due| due >= before))
        .collect();
    assert_eq!(
        runs.len(),
        1,
        "./cancel-order ran {} times for this run:\n{text}\n{said}",
        runs.len()
    );
    let (due, ran): (u64, u64) = (runs[0][1].parse().unwrap(), runs[0][2].parse().unwrap());
    assert!(
        due >= before + delay,
        "due at {due}, sent after {before} with --delay {delay} ms"
    );
    assert!(ran >= due, "./cancel-order ran {} ms early", due - ran);
    let body = flag(&code, "--body").trim_matches('\'');
    assert_eq!(runs[0][3], body, "the body");
    assert!(stubborn.is_empty(), "the consumer ignored SIGTERM for 30 s");
    eprintln!(
        "[runbooks] quick start: ran {} ms after due; took {:.0}s",
        ran - due,
        t0.elapsed().as_secs_f64()
    );
    drop(session);
    drop(teardown);
    let _ = std::fs::remove_dir_all(&dir);
}
