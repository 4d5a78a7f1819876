//! The `[gateway]` section: its pairs and the checks a gateway needs.

use super::*;

/// `[gateway]` section of the configuration.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySettings {
    /// `[[gateway.pairs]]`: ingress exchange → target exchange.
    pub pairs: Vec<PairConfig>,
    /// A message whose `x-delay` is at most this is held by the gateway's worker (unacked in the
    /// ingress queue, so nothing is lost if the gateway dies; in the hold early grain batches
    /// use) and published to its target when due, without the tiers. 0 sends every message
    /// through the tiers. Shorter than `consumer.max_hold`.
    pub hold: DurationMs,
    /// Prefetch slots the gateway adds for the messages it holds, on top of
    /// `consumer.io_concurrency` and `consumer.hold_prefetch`; when all are taken, the broker
    /// waits to deliver more.
    pub max_held: usize,
    /// Also serve every pair registered under the prefix at run time (the control stream's
    /// gateway pair records, e.g. those `delay-proxy` appends), without a restart.
    pub follow: bool,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            pairs: Vec::new(),
            hold: DurationMs(100),
            max_held: 1536,
            follow: false,
        }
    }
}

/// One `[[gateway.pairs]]` entry.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PairConfig {
    /// Exchange applications publish to with `x-delay` (declared by the gateway, fanout).
    pub ingress: String,
    /// Existing exchange the due message is published to, with its original routing key.
    pub target: String,
    /// The users whose ingress messages (by their broker-checked `user_id`) the pair delivers
    /// to the target, besides `trust.admins`; a message of anyone else is parked with the
    /// reason. Empty: every user the broker lets write the ingress (give each application an
    /// ingress of its own, see docs/OPERATIONS.md "Permissions").
    pub writers: Vec<String>,
}

impl GatewaySettings {
    /// Pairs from repeated `--ingress I --target T` flags, matched in order.
    pub fn from_flags(ingress: &[String], target: &[String]) -> Result<GatewaySettings, String> {
        if ingress.len() != target.len() {
            return Err(format!(
                "give one --target per --ingress (got {} --ingress and {} --target)",
                ingress.len(),
                target.len()
            ));
        }
        let pairs = ingress
            .iter()
            .zip(target)
            .map(|(i, t)| PairConfig {
                ingress: i.clone(),
                target: t.clone(),
                writers: Vec::new(),
            })
            .collect();
        let s = GatewaySettings {
            pairs,
            ..GatewaySettings::default()
        };
        s.validate()?;
        Ok(s)
    }

    /// Checks what can be checked without the layout or a broker.
    pub fn validate(&self) -> Result<(), String> {
        if self.hold.as_millis() > 1_000 {
            return Err(format!(
                "gateway.hold must be at most 1s, got {}",
                self.hold
            ));
        }
        if self.max_held == 0 {
            return Err(
                "gateway.max_held must be at least 1 (gateway.hold = 0 holds nothing)".into(),
            );
        }
        let mut seen = std::collections::HashSet::new();
        for p in &self.pairs {
            for (what, name) in [("ingress", &p.ingress), ("target", &p.target)] {
                if name.is_empty() {
                    return Err(format!(
                        "gateway.pairs: every pair needs a non-empty '{what}'"
                    ));
                }
                if name.len() > 255 {
                    return Err(format!(
                        "gateway.pairs: {what} exchange name is {} bytes, more than 255",
                        name.len()
                    ));
                }
            }
            if p.ingress.starts_with("amq.") {
                return Err(format!(
                    "gateway.pairs: ingress '{}' starts with 'amq.', which the broker reserves",
                    p.ingress
                ));
            }
            if p.ingress == p.target {
                return Err(format!(
                    "gateway.pairs: ingress and target are both '{}'; the message would come back to the gateway",
                    p.ingress
                ));
            }
            if !seen.insert(p.ingress.as_str()) {
                return Err(format!(
                    "gateway.pairs: ingress '{}' appears twice; one ingress has one target",
                    p.ingress
                ));
            }
        }
        Ok(())
    }
}
