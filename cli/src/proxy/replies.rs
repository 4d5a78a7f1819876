//! Which broker answer is the one to a request the proxy made for its client (pure: no I/O).
//!
//! The proxy registers a pair only at the broker's `exchange.declare-ok` to the delayed declare
//! it sent, and ends one only at the `exchange.delete-ok` to the delete it sent. A client may
//! have sent other declares or deletes on the same channel before, still unanswered: the
//! broker answers a channel's requests in the order they came, so the proxy's own answer is
//! the one after the answers to those. [`Replies`] counts, per channel, the declares and
//! deletes that ask for an answer (passive ones too) and the answers seen, and names the
//! answer that is the proxy's own.
//!
//! A channel closed and opened again starts afresh: requests sent after the client's
//! `channel.open` are answered after the broker's `channel.open-ok`, so both sides count
//! openings (an epoch), and an answer counts only for the requests of its epoch. A channel the
//! broker closed answers nothing more in that epoch.

use std::collections::HashMap;

/// A request whose answer the proxy may wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// `exchange.declare` (answered by `exchange.declare-ok`).
    Declare,
    /// `exchange.delete` (answered by `exchange.delete-ok`).
    Delete,
}

impl Ask {
    fn index(self) -> usize {
        match self {
            Ask::Declare => 0,
            Ask::Delete => 1,
        }
    }
}

/// One channel as both directions saw it.
#[derive(Debug, Default, Clone, Copy)]
struct Channel {
    /// The client's `channel.open`s.
    opened: u32,
    /// The broker's `channel.open-ok`s.
    confirmed: u32,
    /// The client closed it in epoch `opened` (it sends nothing more there).
    closing: bool,
    /// The epoch in which the broker closed it (0: none).
    refused: u32,
    /// Requests of epoch `opened` that ask for an answer, by [`Ask`].
    sent: [u32; 2],
    /// Answers seen in epoch `confirmed`, by [`Ask`].
    answered: [u32; 2],
}

impl Channel {
    /// Requests of the client's current epoch not answered yet.
    fn unanswered(&self, ask: Ask) -> u32 {
        let i = ask.index();
        if self.opened == self.confirmed {
            self.sent[i].saturating_sub(self.answered[i])
        } else {
            self.sent[i]
        }
    }
}

/// The request the proxy sent and waits for, with `T` (what it does at the answer).
#[derive(Debug)]
struct Own<T> {
    channel: u16,
    ask: Ask,
    epoch: u32,
    /// Answers of the same kind due before it.
    ahead: u32,
    what: T,
}

/// The requests of a connection's channels and the one the proxy waits for (at most one: the
/// client's frames are not read while it waits).
#[derive(Debug)]
pub struct Replies<T> {
    channels: HashMap<u16, Channel>,
    own: Option<Own<T>>,
    /// The broker closed the connection: nothing is answered any more.
    ended: bool,
}

impl<T> Default for Replies<T> {
    fn default() -> Self {
        Replies {
            channels: HashMap::new(),
            own: None,
            ended: false,
        }
    }
}

impl<T> Replies<T> {
    /// Whether the client opened `channel` and has not closed it (as far as it told).
    pub fn is_open(&self, channel: u16) -> bool {
        self.channels
            .get(&channel)
            .is_some_and(|c| c.opened > 0 && !c.closing && c.refused != c.opened)
    }

    /// The client sent `channel.open` on `channel`.
    pub fn client_opened(&mut self, channel: u16) {
        let c = self.channels.entry(channel).or_default();
        c.opened = c.opened.saturating_add(1);
        c.closing = false;
        c.sent = [0; 2];
    }

    /// The client sent `channel.close` on `channel`.
    pub fn client_closed(&mut self, channel: u16) {
        if let Some(c) = self.channels.get_mut(&channel) {
            c.closing = true;
        }
    }

    /// The client sent a request on `channel` that asks for an answer (not `nowait`).
    pub fn sent(&mut self, channel: u16, ask: Ask) {
        if let Some(c) = self.channels.get_mut(&channel) {
            c.sent[ask.index()] = c.sent[ask.index()].saturating_add(1);
        }
    }

    /// The proxy is about to send its own request `ask` on `channel` and wait for its answer,
    /// then do `what`. Gives `what` back when the request can never be answered (the channel
    /// is not open, or closed by either side): the proxy then sends the client's frame as it
    /// came, and the broker ignores or refuses it.
    pub fn expect(&mut self, channel: u16, ask: Ask, what: T) -> Result<(), T> {
        if self.ended || self.own.is_some() || !self.is_open(channel) {
            return Err(what);
        }
        let Some(c) = self.channels.get_mut(&channel) else {
            return Err(what);
        };
        let ahead = c.unanswered(ask);
        c.sent[ask.index()] = c.sent[ask.index()].saturating_add(1);
        self.own = Some(Own {
            channel,
            ask,
            epoch: c.opened,
            ahead,
            what,
        });
        Ok(())
    }

    /// The broker sent `channel.open-ok` on `channel`: a new epoch's answers start.
    pub fn broker_opened(&mut self, channel: u16) {
        let c = self.channels.entry(channel).or_default();
        c.confirmed = c.confirmed.saturating_add(1);
        c.answered = [0; 2];
    }

    /// The broker's answer `ask` on `channel`: what the proxy waited for, when it answers the
    /// proxy's own request.
    pub fn answered(&mut self, channel: u16, ask: Ask) -> Option<T> {
        let c = self.channels.get_mut(&channel)?;
        c.answered[ask.index()] = c.answered[ask.index()].saturating_add(1);
        let epoch = c.confirmed;
        let own = self.own.as_mut()?;
        if own.channel != channel || own.ask != ask || own.epoch != epoch {
            return None;
        }
        if own.ahead > 0 {
            own.ahead -= 1;
            return None;
        }
        self.own.take().map(|o| o.what)
    }

    /// The broker closed `channel` (refused a request on it): what the proxy waited for on it,
    /// never to be answered.
    pub fn broker_closed(&mut self, channel: u16) -> Option<T> {
        let c = self.channels.get_mut(&channel)?;
        c.refused = c.confirmed;
        let epoch = c.confirmed;
        if self
            .own
            .as_ref()
            .is_some_and(|o| o.channel == channel && o.epoch == epoch)
        {
            self.own.take().map(|o| o.what)
        } else {
            None
        }
    }

    /// The broker closed the connection: what the proxy waited for, never to be answered.
    pub fn broker_ended(&mut self) -> Option<T> {
        self.ended = true;
        self.own.take().map(|o| o.what)
    }

    /// Channels known (each a few bytes; at most the connection's `channel_max`).
    pub fn channels(&self) -> usize {
        self.channels.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection with `channel` opened on both sides.
    fn opened(channel: u16) -> Replies<&'static str> {
        let mut r = Replies::default();
        r.client_opened(channel);
        r.broker_opened(channel);
        r
    }

    #[test]
    fn the_proxys_answer_is_the_one_after_the_clients_earlier_requests() {
        // a passive declare of amq.direct, then the delayed declare, in one write
        let mut r = opened(1);
        r.sent(1, Ask::Declare);
        r.expect(1, Ask::Declare, "register").unwrap();
        assert_eq!(r.answered(1, Ask::Declare), None, "the passive declare's");
        assert_eq!(r.answered(1, Ask::Declare), Some("register"));
        // the same with deletes; a declare's answer does not count for a delete
        r.sent(1, Ask::Delete);
        r.sent(1, Ask::Delete);
        r.expect(1, Ask::Delete, "end").unwrap();
        assert_eq!(r.answered(1, Ask::Declare), None);
        assert_eq!(r.answered(1, Ask::Delete), None);
        assert_eq!(r.answered(1, Ask::Delete), None);
        assert_eq!(r.answered(1, Ask::Delete), Some("end"));
    }

    #[test]
    fn a_refused_earlier_request_leaves_nothing_to_match() {
        // the broker refuses the delayed declare after accepting the one before it
        let mut r = opened(1);
        r.sent(1, Ask::Declare);
        r.expect(1, Ask::Declare, "register").unwrap();
        assert_eq!(r.answered(1, Ask::Declare), None);
        assert_eq!(r.broker_closed(1), Some("register"));
        // answers on other channels never match
        let mut r = opened(1);
        r.client_opened(2);
        r.broker_opened(2);
        r.expect(1, Ask::Declare, "register").unwrap();
        assert_eq!(r.answered(2, Ask::Declare), None);
        assert_eq!(r.broker_closed(2), None);
        assert_eq!(r.answered(1, Ask::Declare), Some("register"));
    }

    #[test]
    fn answers_answer_only_the_requests_of_their_epoch() {
        // close, open and requests pipelined before the broker's close-ok and open-ok: the
        // passive declare sent before the close is answered in the old epoch
        let mut r = opened(1);
        r.sent(1, Ask::Declare);
        r.client_closed(1);
        assert_eq!(
            r.expect(1, Ask::Declare, "x"),
            Err("x"),
            "a closing channel"
        );
        r.client_opened(1);
        r.sent(1, Ask::Declare);
        r.expect(1, Ask::Declare, "register").unwrap();
        assert_eq!(r.answered(1, Ask::Declare), None, "the old epoch's");
        r.broker_opened(1);
        assert_eq!(r.answered(1, Ask::Declare), None, "the new passive one's");
        assert_eq!(r.answered(1, Ask::Declare), Some("register"));
        // an open the broker never confirms (a second open of an open channel ends the
        // connection): nothing after it matches
        let mut r = opened(3);
        r.client_opened(3);
        r.expect(3, Ask::Declare, "register").unwrap();
        assert_eq!(r.answered(3, Ask::Declare), None);
        assert_eq!(r.broker_ended(), Some("register"));
        assert_eq!(r.expect(3, Ask::Declare, "y"), Err("y"), "ended");
    }

    #[test]
    fn a_request_that_can_never_be_answered_is_not_waited_for() {
        let mut r: Replies<&str> = Replies::default();
        assert_eq!(r.expect(1, Ask::Declare, "x"), Err("x"), "never opened");
        assert!(!r.is_open(0) && !r.is_open(1));
        let mut r = opened(1);
        r.sent(1, Ask::Declare);
        assert_eq!(r.broker_closed(1), None);
        assert!(!r.is_open(1));
        assert_eq!(
            r.expect(1, Ask::Declare, "x"),
            Err("x"),
            "refused by the broker"
        );
        r.client_opened(1);
        r.broker_opened(1);
        assert!(r.is_open(1));
        r.expect(1, Ask::Declare, "again").unwrap();
        assert_eq!(r.expect(1, Ask::Delete, "z"), Err("z"), "one at a time");
        assert_eq!(r.answered(1, Ask::Declare), Some("again"));
        assert_eq!(r.channels(), 1);
    }
}
