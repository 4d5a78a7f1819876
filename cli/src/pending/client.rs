//! Where the `pending` commands get their answers: a running `pending serve` asked over HTTP
//! with the user and password of `--url` ([`Source::Remote`]), or an index built for this one
//! command from the journal and the control stream ([`Source::Local`], at the scale of
//! thousands). Both answer the same wire forms.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::Settings;
use base64::Engine as _;
use serde::de::DeserializeOwned;

use super::follow::{self, Status, percent_decode};
use super::service::{Failure, Query, Service};
use super::wire::{ErrorOut, PageOut, PurgeOut, ShowOut, StatusOut, SteeredOut};
use crate::pending_index::Viewer;
use crate::schedules::ScheduleOut;
use amqp_delay::ops::control::PurgeScope;
use amqp_delay::ops::control::Reschedule;

/// The server named by `settings`' `pending.index_url`, when one is.
pub fn index_server(settings: &Settings) -> Result<Option<Remote>, Failure> {
    match settings.pending.index_url.as_deref() {
        Some(u) if !u.is_empty() => Remote::new(u, settings).map(Some),
        _ => Ok(None),
    }
}

/// How long one request to a `pending serve` may take.
const TIMEOUT: Duration = Duration::from_secs(60);
/// The largest answer read from a `pending serve` (a page of 1,000 rows with their headers).
const MAX_ANSWER: u64 = 64 << 20;

/// A `pending serve` and the login to ask it with.
pub struct Remote {
    base: url::Url,
    authorization: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("base", &self.base.as_str())
            .finish()
    }
}

impl Remote {
    /// The server at `index_url`, asked as the user of `settings`' broker URL.
    pub fn new(index_url: &str, settings: &Settings) -> Result<Remote, Failure> {
        let base = url::Url::parse(index_url)
            .map_err(|e| Failure::Invalid(format!("pending.index_url '{index_url}': {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.host_str().is_none() {
            return Err(Failure::Invalid(format!(
                "pending.index_url '{index_url}' must be http://HOST:PORT or https://HOST:PORT"
            )));
        }
        let first = amqp_delay::ops::connection::split_urls(&settings.url)
            .into_iter()
            .next()
            .unwrap_or_default();
        let u = url::Url::parse(&first)
            .map_err(|e| Failure::Invalid(format!("the broker URL: {e}")))?;
        let user = percent_decode(u.username());
        if user.is_empty() {
            return Err(Failure::Invalid(
                "the broker URL names no user: the index server is asked as that user".into(),
            ));
        }
        let password = percent_decode(u.password().unwrap_or(""));
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(TIMEOUT))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Remote {
            base,
            authorization: format!("Basic {token}"),
            agent,
        })
    }

    fn url(&self, path: &str, query: &[(&str, String)]) -> Result<String, Failure> {
        let mut u = self
            .base
            .join(path)
            .map_err(|e| Failure::Invalid(format!("pending.index_url: {e}")))?;
        if !query.is_empty() {
            u.query_pairs_mut().extend_pairs(query);
        }
        Ok(u.to_string())
    }

    async fn call<T: DeserializeOwned + Send + 'static>(
        &self,
        post: Option<serde_json::Value>,
        url: String,
    ) -> Result<T, Failure> {
        let agent = self.agent.clone();
        let auth = self.authorization.clone();
        let shown = url.clone();
        let answer = tokio::task::spawn_blocking(move || -> Result<(u16, String), String> {
            let mut r = match post {
                Some(body) => agent
                    .post(&url)
                    .header("authorization", &auth)
                    .header("content-type", "application/json")
                    .send(body.to_string().as_bytes())
                    .map_err(|e| e.to_string())?,
                None => agent
                    .get(&url)
                    .header("authorization", &auth)
                    .call()
                    .map_err(|e| e.to_string())?,
            };
            let status = r.status().as_u16();
            let text = r
                .body_mut()
                .with_config()
                .limit(MAX_ANSWER)
                .read_to_string()
                .map_err(|e| e.to_string())?;
            Ok((status, text))
        })
        .await
        .map_err(|e| Failure::Unavailable(format!("the HTTP task failed: {e}")))?
        .map_err(|e| Failure::Unavailable(format!("asking the index server ({shown}): {e}")))?;
        decode(answer.0, &answer.1)
    }
}

/// The list `GET /api/v1/schedules` answers.
#[derive(serde::Deserialize)]
struct SchedulesOut {
    schedules: Vec<ScheduleOut>,
    #[serde(default)]
    next: Option<String>,
}

impl Remote {
    /// A page of the recurring schedules the login sees, from the server's live book, and the
    /// cursor of the next page if more follow.
    pub async fn schedules(
        &self,
        page: &crate::schedules::Page,
    ) -> Result<(Vec<ScheduleOut>, Option<String>), Failure> {
        let mut q = vec![("limit", page.limit.to_string())];
        if let Some((o, n)) = &page.after {
            q.push(("after", format!("{o}/{n}")));
        }
        let out: SchedulesOut = self.call(None, self.url("api/v1/schedules", &q)?).await?;
        Ok((out.schedules, out.next))
    }

    /// Recurring schedule `name` (of `owner`, an admin's question) with its next ticks.
    pub async fn schedule(&self, name: &str, owner: Option<&str>) -> Result<ScheduleOut, Failure> {
        let mut u = self
            .base
            .join("api/v1/schedules/")
            .map_err(|e| Failure::Invalid(e.to_string()))?;
        u.path_segments_mut()
            .map_err(|()| Failure::Invalid("pending.index_url cannot hold a path".into()))?
            .pop_if_empty()
            .push(name);
        if let Some(o) = owner {
            u.query_pairs_mut().append_pair("owner", o);
        }
        self.call(None, u.to_string()).await
    }
}

/// An answer of a `pending serve`: its JSON, or its error as a [`Failure`].
fn decode<T: DeserializeOwned>(status: u16, text: &str) -> Result<T, Failure> {
    if (200..300).contains(&status) {
        return serde_json::from_str(text)
            .map_err(|e| Failure::Unavailable(format!("the index server answered: {e}")));
    }
    let why = serde_json::from_str::<ErrorOut>(text)
        .map(|e| e.error)
        .unwrap_or_else(|_| format!("HTTP {status}"));
    Err(match status {
        401 => Failure::Invalid(format!(
            "the index server refused the login of --url's user: {why}"
        )),
        404 => Failure::NotFound(why),
        429 => Failure::Quota(why),
        400..=499 => Failure::Invalid(why),
        _ => Failure::Unavailable(format!("the index server: {why}")),
    })
}

/// Where the answers come from.
pub enum Source {
    /// A running `pending serve`.
    Remote(Remote),
    /// An index read from the streams for this command; steering as `settings`' user.
    Local(Box<Service>),
}

impl Source {
    /// The source `settings` name: their `pending.index_url`, else a temporary index read from
    /// the streams now.
    pub async fn open(settings: &Settings) -> Result<Source, Failure> {
        if let Some(u) = settings
            .pending
            .index_url
            .as_deref()
            .filter(|u| !u.is_empty())
        {
            return Ok(Source::Remote(Remote::new(u, settings)?));
        }
        let conn = Connector::new(settings)?
            .connect("amqp-delay pending")
            .await?;
        let built = follow::build_once(settings, &conn).await;
        amqp_delay::ops::broker::close_connection(&conn, "bye").await;
        let (ix, end) = built?;
        let status = Status::settled(end);
        Ok(Source::Local(Box::new(Service::new(
            settings.clone(),
            Arc::new(Mutex::new(ix)),
            status,
        ))))
    }

    fn viewer(service: &Service) -> Result<Viewer, Failure> {
        let user = follow::url_user(service.settings()).ok_or_else(|| {
            Failure::Invalid("the broker URL names no user: pending answers as a user".into())
        })?;
        Ok(service.viewer(&user))
    }

    /// One page.
    pub async fn list(&self, q: &Query) -> Result<PageOut, Failure> {
        match self {
            Source::Local(s) => s.list(Source::viewer(s)?, q).await,
            Source::Remote(r) => {
                let mut p: Vec<(&str, String)> = Vec::new();
                if let Some(v) = &q.queue {
                    p.push(("queue", v.clone()));
                }
                if let Some(v) = q.due_after_ms {
                    p.push(("due_after", v.to_string()));
                }
                if let Some(v) = q.due_before_ms {
                    p.push(("due_before", v.to_string()));
                }
                if let Some((k, v)) = &q.header {
                    p.push(("header", format!("{k}={v}")));
                }
                if let Some(v) = q.limit {
                    p.push(("limit", v.to_string()));
                }
                if let Some(v) = &q.after {
                    p.push(("after", v.clone()));
                }
                r.call(None, r.url("api/v1/pending", &p)?).await
            }
        }
    }

    /// One message id, with body and history.
    pub async fn show(&self, id: &str, owner: Option<&str>) -> Result<ShowOut, Failure> {
        match self {
            Source::Local(s) => s.show(Source::viewer(s)?, id, owner).await,
            Source::Remote(r) => {
                let mut u = r
                    .base
                    .join("api/v1/pending/")
                    .map_err(|e| Failure::Invalid(e.to_string()))?;
                u.path_segments_mut()
                    .map_err(|()| Failure::Invalid("pending.index_url cannot hold a path".into()))?
                    .pop_if_empty()
                    .push(id);
                if let Some(o) = owner {
                    u.query_pairs_mut().append_pair("owner", o);
                }
                r.call(None, u.to_string()).await
            }
        }
    }

    /// A purge of what `scope` covers (or with `dry_run`, its count).
    pub async fn purge(&self, scope: &PurgeScope, dry_run: bool) -> Result<PurgeOut, Failure> {
        match self {
            Source::Local(s) => s.purge(s.settings(), scope, dry_run).await,
            Source::Remote(r) => {
                let body = serde_json::json!({
                    "queue": scope.queue,
                    "owner": scope.owner,
                    "due_after": scope.due_after_ms,
                    "due_before": scope.due_before_ms,
                    "header": scope.header.as_ref().map(|(k, v)| format!("{k}={v}")),
                    "dry_run": dry_run,
                });
                r.call(Some(body), r.url("api/v1/pending/purge", &[])?)
                    .await
            }
        }
    }

    fn action_url(r: &Remote, id: &str, action: &str) -> Result<String, Failure> {
        let mut u = r
            .base
            .join("api/v1/pending/")
            .map_err(|e| Failure::Invalid(e.to_string()))?;
        u.path_segments_mut()
            .map_err(|()| Failure::Invalid("pending.index_url cannot hold a path".into()))?
            .pop_if_empty()
            .push(id)
            .push(action);
        Ok(u.to_string())
    }

    /// Moves message `r.id`.
    pub async fn reschedule(&self, r: &Reschedule) -> Result<SteeredOut, Failure> {
        match self {
            Source::Local(s) => s.reschedule(s.settings(), r).await,
            Source::Remote(remote) => {
                let body = serde_json::json!({ "at": r.due_at_ms, "owner": r.owner });
                remote
                    .call(Some(body), Source::action_url(remote, &r.id, "reschedule")?)
                    .await
            }
        }
    }

    /// Cancels message `id`.
    pub async fn cancel(&self, id: &str, owner: Option<&str>) -> Result<SteeredOut, Failure> {
        match self {
            Source::Local(s) => s.cancel(s.settings(), id, owner).await,
            Source::Remote(r) => {
                let body = serde_json::json!({ "owner": owner });
                r.call(Some(body), Source::action_url(r, id, "cancel")?)
                    .await
            }
        }
    }

    /// How far behind the index is.
    pub async fn status(&self) -> Result<StatusOut, Failure> {
        match self {
            Source::Local(s) => Ok(StatusOut {
                lag: s.status().lag(),
            }),
            Source::Remote(r) => r.call(None, r.url("api/v1/status", &[])?).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_error_becomes_the_failure_of_its_status() {
        let body = r#"{"error":"no message with id 'x' that you can see"}"#;
        let e = decode::<StatusOut>(404, body).unwrap_err();
        assert!(
            matches!(e, Failure::NotFound(ref m) if m.contains("no message")),
            "{e:?}"
        );
        assert!(matches!(
            decode::<StatusOut>(400, "{}"),
            Err(Failure::Invalid(_))
        ));
        let e = decode::<StatusOut>(401, body).unwrap_err();
        assert!(e.to_string().contains("refused the login"), "{e}");
        assert!(matches!(
            decode::<StatusOut>(503, "x"),
            Err(Failure::Unavailable(_))
        ));
        assert!(matches!(
            decode::<StatusOut>(200, "not json"),
            Err(Failure::Unavailable(_))
        ));
    }

    #[test]
    fn the_index_url_must_be_http_and_the_broker_url_name_a_user() {
        let mut s = Settings::default();
        assert!(Remote::new("ftp://x", &s).is_err());
        assert!(Remote::new("not a url", &s).is_err());
        let r = Remote::new("http://127.0.0.1:8471", &s).unwrap();
        assert_eq!(
            Source::action_url(&r, "a/b c", "cancel").unwrap(),
            "http://127.0.0.1:8471/api/v1/pending/a%2Fb%20c/cancel"
        );
        assert!(!format!("{r:?}").contains("Basic"));
        s.url = "amqp://127.0.0.1/%2f".into();
        assert!(Remote::new("http://127.0.0.1:8471", &s).is_err());
    }
}
