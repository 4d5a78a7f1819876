//! Steering what waits, as a publisher's user: cancels (tombstones), purges and reschedules,
//! each a control-stream record the followers honour.

use super::*;

impl Publisher {
    /// Cancels message `id`: records a tombstone in the control stream and returns once the
    /// broker confirmed it. From then on no worker, gateway or relay runs or forwards the
    /// message. With its due time (from [`Scheduled`]) the tombstone is forgotten sooner and the
    /// answer says whether the cancel is certain to win (docs/DESIGN.md, "Cancellation").
    pub async fn cancel(&self, id: &str, due_at_ms: Option<u64>) -> Result<Cancelled> {
        if id.is_empty() || id.len() > 255 {
            return Err(Error::Invalid("a message id is 1 to 255 bytes".into()));
        }
        let (record, verdict) = tombstone(
            id,
            due_at_ms,
            now_ms(),
            self.inner.layout.max_delay_ms(),
            self.cancel.notice.as_millis(),
            self.cancel.horizon.as_millis(),
        );
        let until_ms = match &record {
            Record::Cancel { until_ms, .. } => *until_ms,
            _ => 0,
        };
        self.append_control(&record).await?;
        Ok(Cancelled {
            id: id.to_string(),
            until_ms,
            verdict,
        })
    }

    /// [`Publisher::cancel`] of a message this publisher scheduled.
    pub async fn cancel_scheduled(&self, s: &Scheduled) -> Result<Cancelled> {
        self.cancel(&s.message_id, Some(s.due_at_ms)).await
    }

    /// Cancels many: up to 1,000 tombstones travel in one record of the control stream, a few
    /// records awaiting their confirm at once. Results as they complete, with their tag.
    pub fn cancel_all<'a, T: Send + 'a>(
        &'a self,
        items: impl Stream<Item = (T, String, Option<u64>)> + 'a,
    ) -> impl Stream<Item = (T, Result<Cancelled>)> + 'a {
        items
            .ready_chunks(1_000)
            .map(move |chunk| self.cancel_chunk(chunk))
            .buffer_unordered(8)
            .flat_map(futures::stream::iter)
    }

    async fn cancel_chunk<T>(
        &self,
        chunk: Vec<(T, String, Option<u64>)>,
    ) -> Vec<(T, Result<Cancelled>)> {
        let now = now_ms();
        let mut out = Vec::with_capacity(chunk.len());
        let mut good = Vec::new();
        for (tag, id, due) in chunk {
            if id.is_empty() || id.len() > 255 {
                out.push((
                    tag,
                    Err(Error::Invalid("a message id is 1 to 255 bytes".into())),
                ));
                continue;
            }
            let (record, verdict) = tombstone(
                &id,
                due,
                now,
                self.inner.layout.max_delay_ms(),
                self.cancel.notice.as_millis(),
                self.cancel.horizon.as_millis(),
            );
            let until_ms = match record {
                Record::Cancel { until_ms, .. } => until_ms,
                _ => 0,
            };
            good.push((
                tag,
                Cancelled {
                    id,
                    until_ms,
                    verdict,
                },
            ));
        }
        if good.is_empty() {
            return out;
        }
        let record = Record::Cancels {
            items: good
                .iter()
                .map(|(_, c)| (c.id.clone(), c.until_ms))
                .collect(),
        };
        let r = self.append_control(&record).await;
        for (tag, c) in good {
            out.push((
                tag,
                match &r {
                    Ok(()) => Ok(c),
                    Err(e) => Err(e.clone()),
                },
            ));
        }
        out
    }

    /// Records a purge of what `scope` covers in the control stream: every worker, gateway and
    /// relay then acks what it covers without running it. It covers what was scheduled before
    /// now, and is forgotten once no message it covers can fall due. A user's (no admin's)
    /// purge covers only its own messages. Returns the record as written.
    pub async fn purge(&self, scope: crate::control::PurgeScope) -> Result<crate::control::Purge> {
        scope.check().map_err(Error::Invalid)?;
        self.inner
            .layout
            .validate_destination(&scope.queue)
            .map_err(Error::Invalid)?;
        let now = now_ms();
        let latest = now.saturating_add(self.inner.layout.max_delay_ms());
        let latest = scope.due_before_ms.map_or(latest, |b| b.min(latest));
        let purge = crate::control::Purge {
            nonce: uuid::Uuid::now_v7().to_string(),
            scope,
            scheduled_before_ms: now,
            until_ms: latest.saturating_add(self.cancel.horizon.as_millis()),
        };
        self.append_control(&Record::Purge(purge.clone())).await?;
        Ok(purge)
    }

    /// Moves message `to.id` (of `to.owner`, for an admin; `None`: the caller's own, or
    /// anyone's for an admin), due at `from_due_ms`, to `to.due_at_ms` (now, if that has
    /// passed). Later: one control record; the worker that takes the message at its old due
    /// time sends it round the tiers again. Earlier (or now): `copy` — the message rebuilt from
    /// the journal's kept body — is published due at the new time first, then the record makes
    /// the old copy be acked without running. Without `copy` an earlier time is refused: the
    /// body was not kept.
    pub async fn reschedule(
        &self,
        to: &crate::control::Reschedule,
        from_due_ms: u64,
        copy: Option<Message>,
    ) -> Result<Cancelled> {
        let now = now_ms();
        to.check().map_err(Error::Invalid)?;
        let id = to.id.as_str();
        let due_at_ms = to.due_at_ms.max(now);
        let latest = now.saturating_add(self.inner.layout.max_delay_ms());
        if due_at_ms > latest {
            return Err(Error::Invalid(format!(
                "the new due time is further away than the topology's longest delay ({} ms)",
                self.inner.layout.max_delay_ms()
            )));
        }
        if due_at_ms < from_due_ms {
            let Some(mut copy) = copy else {
                return Err(Error::Invalid(format!(
                    "message '{id}' can only be moved later: its body was not kept \
                     (journal.keep_body is off, or it was larger than journal.max_body), so no \
                     earlier copy can be sent"
                )));
            };
            copy.due_at = Some(due_at_ms);
            copy.delay_ms = due_at_ms.saturating_sub(now);
            copy.attempt = 0;
            self.schedule(copy.with_id(id).unjournaled()).await?;
        }
        let verdict = if from_due_ms >= now.saturating_add(self.cancel.notice.as_millis()) {
            crate::cancel::Verdict::Honoured
        } else {
            crate::cancel::Verdict::TooLate
        };
        let until_ms = from_due_ms
            .max(due_at_ms)
            .min(latest)
            .saturating_add(self.cancel.horizon.as_millis());
        self.append_control(&Record::Reschedule {
            to: crate::control::Reschedule {
                due_at_ms,
                ..to.clone()
            },
            until_ms,
        })
        .await?;
        Ok(Cancelled {
            id: id.to_string(),
            until_ms,
            verdict,
        })
    }
}
