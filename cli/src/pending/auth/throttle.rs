//! Wrong passwords, throttled, pure: per user name and per client address (an IPv6 address
//! counts by its /64), [`FREE_FAILURES`] failures pass, and from then on each failure blocks
//! further attempts for twice as long as the one before, from [`FIRST_BLOCK`] up to
//! [`MAX_BLOCK`]. Failures are forgotten after [`FORGIVE`] without one once any block has
//! ended; a success forgets its user's. Attempts while blocked are not asked of the broker
//! and count as nothing. Memory is bounded: [`MAX_TRACKED`] users and addresses each, the
//! forgiven dropped first, then the longest quiet.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Failures that pass before the first block.
pub const FREE_FAILURES: u32 = 5;
/// The block after the [`FREE_FAILURES`]th failure; each later failure doubles it.
pub const FIRST_BLOCK: Duration = Duration::from_secs(1);
/// The longest block.
pub const MAX_BLOCK: Duration = Duration::from_secs(15 * 60);
/// How long without a failure (after any block ended) until failures are forgotten.
pub const FORGIVE: Duration = Duration::from_secs(60);
/// Users, and addresses, tracked at most.
pub const MAX_TRACKED: usize = 10_000;

/// One key's failures.
#[derive(Debug, Clone, Copy)]
struct Strikes {
    failures: u32,
    /// The last failure, or the end of the block it set, whichever is later.
    quiet_from: Instant,
    blocked_until: Option<Instant>,
}

impl Strikes {
    fn forgiven(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.quiet_from) > FORGIVE
    }
}

#[derive(Debug)]
struct Tracked<K> {
    map: HashMap<K, Strikes>,
}

impl<K: Hash + Eq + Clone> Tracked<K> {
    fn new() -> Tracked<K> {
        Tracked {
            map: HashMap::new(),
        }
    }

    fn blocked(&self, key: &K, now: Instant) -> Option<Duration> {
        let s = self.map.get(key)?;
        s.blocked_until
            .filter(|u| *u > now)
            .map(|u| u.saturating_duration_since(now))
    }

    fn fail(&mut self, key: &K, now: Instant) {
        if !self.map.contains_key(key) {
            self.make_room(now);
        }
        let s = self.map.entry(key.clone()).or_insert(Strikes {
            failures: 0,
            quiet_from: now,
            blocked_until: None,
        });
        if s.forgiven(now) {
            s.failures = 0;
        }
        s.failures = s.failures.saturating_add(1);
        s.quiet_from = now;
        s.blocked_until = None;
        if s.failures >= FREE_FAILURES {
            let doublings = (s.failures - FREE_FAILURES).min(30);
            let block = FIRST_BLOCK.saturating_mul(1 << doublings).min(MAX_BLOCK);
            s.blocked_until = Some(now + block);
            s.quiet_from = now + block;
        }
    }

    fn make_room(&mut self, now: Instant) {
        if self.map.len() < MAX_TRACKED {
            return;
        }
        self.map.retain(|_, s| !s.forgiven(now));
        if self.map.len() >= MAX_TRACKED
            && let Some(k) = self
                .map
                .iter()
                .min_by_key(|(_, s)| s.quiet_from)
                .map(|(k, _)| k.clone())
        {
            self.map.remove(&k);
        }
    }
}

/// The failures of logins by user and by client address.
#[derive(Debug)]
pub struct Throttle {
    users: Tracked<String>,
    addrs: Tracked<IpAddr>,
}

impl Default for Throttle {
    fn default() -> Throttle {
        Throttle {
            users: Tracked::new(),
            addrs: Tracked::new(),
        }
    }
}

/// The key of a client address: an IPv6 address by its /64 (what one client can pick from).
fn addr_key(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(bits.into())
            }
        },
        v4 => v4,
    }
}

impl Throttle {
    /// How much longer a login of `user` from `addr` is refused, if it is.
    pub fn blocked(&self, user: &str, addr: Option<IpAddr>, now: Instant) -> Option<Duration> {
        let by_user = self.users.blocked(&user.to_string(), now);
        let by_addr = addr.and_then(|a| self.addrs.blocked(&addr_key(a), now));
        by_user.max(by_addr)
    }

    /// Counts a wrong password for `user` from `addr`.
    pub fn failed(&mut self, user: &str, addr: Option<IpAddr>, now: Instant) {
        self.users.fail(&user.to_string(), now);
        if let Some(a) = addr {
            self.addrs.fail(&addr_key(a), now);
        }
    }

    /// Forgets `user`'s failures: its password was right.
    pub fn succeeded(&mut self, user: &str) {
        self.users.map.remove(user);
    }

    /// Users and addresses tracked now.
    pub fn tracked(&self) -> (usize, usize) {
        (self.users.map.len(), self.addrs.map.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn five_failures_pass_then_each_blocks_twice_as_long() {
        let mut t = Throttle::default();
        let mut now = Instant::now();
        let from = ip("192.0.2.1");
        for _ in 0..FREE_FAILURES - 1 {
            assert_eq!(t.blocked("alice", from, now), None);
            t.failed("alice", from, now);
        }
        assert_eq!(t.blocked("alice", from, now), None);
        t.failed("alice", from, now);
        let mut want = FIRST_BLOCK;
        for _ in 0..15 {
            assert_eq!(t.blocked("alice", from, now), Some(want));
            // another address, same user: blocked too; another user from elsewhere: not
            assert_eq!(t.blocked("alice", ip("198.51.100.7"), now), Some(want));
            assert_eq!(t.blocked("bob", ip("198.51.100.7"), now), None);
            now += want;
            assert_eq!(t.blocked("alice", from, now), None, "the block ends");
            t.failed("alice", from, now);
            want = (want * 2).min(MAX_BLOCK);
        }
        assert_eq!(want, MAX_BLOCK);
        // a quiet spell after the block forgives; a success forgets the user's
        now += MAX_BLOCK + FORGIVE + Duration::from_secs(1);
        t.failed("alice", from, now);
        assert_eq!(t.blocked("alice", from, now), None);
        t.succeeded("alice");
        assert_eq!(t.blocked("alice", None, now), None);
    }

    #[test]
    fn one_address_trying_many_users_is_blocked_by_its_address() {
        let mut t = Throttle::default();
        let now = Instant::now();
        let from = ip("2001:db8::1");
        for i in 0..FREE_FAILURES {
            t.failed(&format!("user{i}"), from, now);
        }
        assert_eq!(t.blocked("someone-else", from, now), Some(FIRST_BLOCK));
        // the same /64
        assert_eq!(
            t.blocked("x", ip("2001:db8::ffff:1"), now),
            Some(FIRST_BLOCK)
        );
        assert_eq!(t.blocked("x", ip("2001:db8:0:1::1"), now), None);
        assert_eq!(t.blocked("x", None, now), None);
    }

    #[test]
    fn memory_stays_bounded_whatever_names_and_addresses_are_tried() {
        let mut t = Throttle::default();
        let now = Instant::now();
        for i in 0..(MAX_TRACKED as u32 + 500) {
            let a = IpAddr::V4(std::net::Ipv4Addr::from(i));
            t.failed(&format!("u{i}"), Some(a), now);
        }
        let (users, addrs) = t.tracked();
        assert!(
            users <= MAX_TRACKED && addrs <= MAX_TRACKED,
            "{users} {addrs}"
        );
    }
}
