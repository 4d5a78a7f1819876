//! The documentation's procedures, run as written: MIGRATING's "Change only the URL", runbook A
//! (in place), B (blue-green) and C (amqp-delay itself to a new cluster, `transfer`), and the
//! README's quick start "by hand". Their ```sh blocks are read from the markdown at run time
//! (`markdown`), so the test runs what the docs say today, and run in order with
//! `bash -euo pipefail -c` as one terminal session (`shell`), with only the environment the
//! text names: the users it names, made as it says, with the permission sets its own
//! `permissions.sh` line gives them, the machine's packaged `rabbitmqctl` (as root), the
//! plugin from /work/shared/plugin with a backlog loaded first (`nodes`, `app`). Nothing else is
//! set up: no `trust.peers`, no URL or setting the text does not give.
//!
//! Runbooks A and B run on throwaway 3.10 nodes beside the main broker
//! (`scripts/runbook-nodes.sh`), C from the main broker to the 4.3 node of
//! `scripts/rabbitmq4.sh`; the quick start runs against the main broker on 127.0.0.1:5672, as
//! the README says, with a prefix of its own (`AMQP_DELAY_PREFIX`, which the README names). Runs
//! of this binary on one machine take turns (a lock file): the nodes' names and the quick
//! start's queue are fixed.

mod app;
mod change_url;
mod markdown;
mod migrating;
mod nodes;
mod quick_start;
mod shell;
mod transfer;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository's root.
pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The text of a document of the repository (`docs/MIGRATING.md`), as it is now.
pub fn read_doc(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path))
        .unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// Waits until no other run of this binary on the machine holds the lock, then holds it until
/// the process exits.
pub fn machine_lock() {
    static LOCK: OnceLock<nix::fcntl::Flock<std::fs::File>> = OnceLock::new();
    LOCK.get_or_init(|| {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(std::env::temp_dir().join("amqp-delay-runbooks.lock"))
            .expect("opening the runbooks' lock file");
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("locking the runbooks' lock file")
    });
}

/// A fresh working directory for one procedure, as a user's would be in a clone of the
/// repository (`deploy/` there: the text runs `deploy/rabbitmq/permissions.sh`), with a `bin/`
/// holding the tools (what `cargo install --path cli` installs: the test built them). A failed
/// run leaves it, with every block's output, until the next run.
pub fn workdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("amqp-delay-runbooks-work")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::os::unix::fs::symlink(Path::new(ROOT).join("deploy"), dir.join("deploy")).unwrap();
    for (tool, path) in [
        ("delay-publisher", env!("CARGO_BIN_EXE_delay-publisher")),
        ("delay-consumer", env!("CARGO_BIN_EXE_delay-consumer")),
        ("delay-proxy", env!("CARGO_BIN_EXE_delay-proxy")),
        ("delay-console", env!("CARGO_BIN_EXE_delay-console")),
    ] {
        std::os::unix::fs::symlink(path, dir.join("bin").join(tool)).unwrap();
    }
    dir
}

/// What a user's shell has without anything of ours: the tools first on PATH, then the
/// system's (/usr/sbin's packaged rabbitmqctl, rabbitmq-plugins, /usr/bin's rabbitmqadmin), a
/// HOME and a locale.
pub fn base_env(dir: &Path) -> Vec<(String, String)> {
    vec![
        (
            "PATH".into(),
            format!(
                "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                dir.join("bin").display()
            ),
        ),
        ("HOME".into(), dir.display().to_string()),
        ("LANG".into(), "C.UTF-8".into()),
    ]
}
