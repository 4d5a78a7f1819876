//! The runbooks' brokers: throwaway 3.10 nodes of `scripts/runbook-nodes.sh` beside the main
//! broker, and the users the text names, made as it says (`rabbitmqctl add_user NAME` asks for
//! the password). The machine's packaged tools reach a node as on its own host:
//! `RABBITMQ_CONF_ENV_FILE` names its `rabbitmq-env.conf`, which Debian's scripts read.

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Output, Stdio};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/runbook-nodes.sh");
/// The machine's packaged rabbitmqctl (Debian's wrapper: as root it runs the CLI as rabbitmq).
pub(crate) const RABBITMQCTL: &str = "/usr/sbin/rabbitmqctl";

/// A node started for one test and stopped (its files deleted) when dropped.
pub(crate) struct Node {
    which: &'static str,
    pub name: String,
    pub amqp_port: u16,
    pub mgmt_port: Option<u16>,
    pub conf_env_file: String,
}

impl Node {
    /// Starts `which` afresh (`a`, `b-old` or `b-new`): nothing left from an earlier run.
    pub(crate) fn up(which: &'static str) -> Node {
        let out = Command::new("bash")
            .args([SCRIPT, which, "up"])
            .output()
            .expect("running scripts/runbook-nodes.sh");
        assert!(
            out.status.success(),
            "THE RUNBOOK NODE {which} DID NOT START (scripts/runbook-nodes.sh {which} up; needs root, \
             the rabbitmq-server package and /work/shared/plugin):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kv: HashMap<String, String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let node = Node {
            which,
            name: kv["NAME"].clone(),
            amqp_port: kv["AMQP_PORT"].parse().unwrap(),
            mgmt_port: kv.get("MGMT_PORT").map(|p| p.parse().unwrap()),
            conf_env_file: kv["CONF_ENV_FILE"].clone(),
        };
        node.check_the_tools_reach_it();
        node
    }

    /// The URL of `user` on this node.
    pub(crate) fn url(&self, user: &str, password: &str) -> String {
        format!("amqp://{user}:{password}@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// The broker administrator's URL: what the test itself observes with, never the runbook.
    pub(crate) fn guest_url(&self) -> String {
        self.url("guest", "guest")
    }

    /// The packaged `rabbitmqctl ARGS` on this node, `stdin` written to it.
    pub(crate) fn ctl(&self, args: &[&str], stdin: &str) -> Output {
        self.tool(RABBITMQCTL, args, stdin)
    }

    fn tool(&self, tool: &str, args: &[&str], stdin: &str) -> Output {
        let mut child = Command::new(tool)
            .args(args)
            .env("RABBITMQ_CONF_ENV_FILE", &self.conf_env_file)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("running {tool}: {e}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// The runbook's commands reach this node and never another: rabbitmqctl answers with its
    /// name and rabbitmq-plugins reads its enabled-plugins file, not the main broker's.
    fn check_the_tools_reach_it(&self) {
        let out = self.ctl(&["eval", "node()."], "");
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            said.trim(),
            self.name,
            "RABBITMQ_CONF_ENV_FILE={} does not point {RABBITMQCTL} at {}: refusing to run the \
             runbook ({})",
            self.conf_env_file,
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let out = self.tool("/usr/sbin/rabbitmq-plugins", &["list", "-e", "-m"], "");
        let listed = String::from_utf8_lossy(&out.stdout);
        assert!(
            listed.contains("rabbitmq_management") || listed.contains("rabbitmq_delayed"),
            "rabbitmq-plugins does not read {}'s enabled plugins: {listed}",
            self.name
        );
    }

    /// Makes `user` with `password` as the text says: `rabbitmqctl add_user NAME` asks for it.
    pub(crate) fn add_user(&self, user: &str, password: &str) {
        let out = self.ctl(&["add_user", user], &format!("{password}\n"));
        assert!(
            out.status.success(),
            "rabbitmqctl add_user {user} on {}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Users with a permission on `/`, as `rabbitmqctl list_permissions` lists them.
    pub(crate) fn users_with_permissions(&self) -> Vec<String> {
        let out = self.ctl(&["-q", "list_permissions", "-p", "/"], "");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split('\t').next())
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .args([SCRIPT, self.which, "down"])
            .output();
    }
}

/// The users of a runbook, each with a password of this run.
pub(crate) struct Users {
    pub passwords: HashMap<String, String>,
}

/// The users whose `--url`s the runbooks name (MIGRATING: the admin and the
/// proxy's users of `permissions.sh`) and the application's.
pub(crate) const ADMIN: &str = "amqp-delay-admin";
pub(crate) const PROXY: &str = "amqp-delay-proxy";
pub(crate) const APP: &str = "app-user";

impl Users {
    /// Makes `names` on `node`.
    pub(crate) fn make(node: &Node, names: &[String]) -> Users {
        let run: u32 = rand::random();
        let passwords: HashMap<String, String> = names
            .iter()
            .map(|u| (u.clone(), format!("{}-{run:08x}", u.replace('-', ""))))
            .collect();
        // one rabbitmqctl each (a CLI start takes seconds): side by side
        std::thread::scope(|s| {
            for (u, p) in &passwords {
                s.spawn(move || node.add_user(u, p));
            }
        });
        Users { passwords }
    }

    /// `user`'s URL on `node`.
    pub(crate) fn url(&self, node: &Node, user: &str) -> String {
        let password = self
            .passwords
            .get(user)
            .unwrap_or_else(|| panic!("permissions.sh names no user {user}"));
        node.url(user, password)
    }
}
