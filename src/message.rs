//! What a caller schedules and what it gets back, pure: a [`Message`] (destination, delay, body,
//! properties) and the [`Scheduled`] confirmation with its route.

use lapin::BasicProperties;
use lapin::types::FieldTable;

use crate::planner::Route;

/// A message to deliver to `destination` (a queue name) after `delay_ms`.
#[derive(Debug, Clone)]
pub struct Message {
    /// Destination queue.
    pub destination: String,
    /// Requested delay in milliseconds.
    pub delay_ms: u64,
    /// Body, delivered byte-for-byte.
    pub body: Vec<u8>,
    /// The caller's properties (content type, headers, correlation id, ...), kept as they are.
    /// `message_id` is generated (UUID v7) when absent; `delivery_mode` is always persistent.
    pub properties: BasicProperties,
    /// Delivery attempt written to `x-delay-attempt` (0 on first schedule).
    pub attempt: u32,
}

impl Message {
    /// A message to `destination` after `delay_ms`, with default properties.
    pub fn new(destination: impl Into<String>, delay_ms: u64, body: impl Into<Vec<u8>>) -> Self {
        Message {
            destination: destination.into(),
            delay_ms,
            body: body.into(),
            properties: BasicProperties::default(),
            attempt: 0,
        }
    }
    /// Sets the message id (default: a generated UUID v7).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.properties = self.properties.with_message_id(id.into().as_str().into());
        self
    }
    /// Sets the content type.
    pub fn with_content_type(mut self, ct: impl Into<String>) -> Self {
        self.properties = self.properties.with_content_type(ct.into().as_str().into());
        self
    }
    /// Sets the application headers (`x-delay-*` names are reserved).
    pub fn with_headers(mut self, h: FieldTable) -> Self {
        self.properties = self.properties.with_headers(h);
        self
    }
    /// Replaces all properties.
    pub fn with_properties(mut self, p: BasicProperties) -> Self {
        self.properties = p;
        self
    }
    /// Sets the attempt counter (used by retries).
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }
}

/// A message the broker has confirmed.
#[derive(Debug, Clone)]
pub struct Scheduled {
    /// The message id (given or generated).
    pub message_id: String,
    /// The requested delay.
    pub delay_ms: u64,
    /// Requested due time, ms since the Unix epoch.
    pub due_at_ms: u64,
    /// The route through the tiers (of its batch, when it travels in one).
    pub route: Route,
    /// How many messages share its broker message (1: it travels alone).
    pub batched_with: usize,
}
