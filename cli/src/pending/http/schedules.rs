//! `/api/v1/schedules`: recurring schedules through [`crate::schedules`], the code the CLI's
//! `recurring` commands run, as the logged-in user (its own; an admin's: everyone's, naming
//! `owner`). Read from the server's live book ([`crate::schedules::Live`], caught up with the
//! stream before each answer: a write confirmed before a GET is in it); written on a
//! connection of the logged-in user.
//!
//! | method and path | what |
//! |---|---|
//! | `GET /api/v1/schedules?after=&limit=` | `{"schedules": [...], "next"}`: a page (1 000 by default, at most 10 000), each with its next tick; `next` is the cursor of the page after it, if any |
//! | `GET /api/v1/schedules/{name}?owner=` | one, with its next five ticks |
//! | `POST /api/v1/schedules` | `{"name", "cron", "queue", "tz"?, "body"?, "headers"?: {K: V}, "misfire"?, "from"?, "until"?}`: 201 and its next tick |
//! | `POST /api/v1/schedules/{name}/{pause,resume,remove,run-now,purge}` | `{"owner"?}` (or no body) |

use std::collections::BTreeMap;

use amqp_delay::recurring::{Action, Definition, Misfire, rfc3339};

use super::*;
use crate::schedules::{self, Books, Page, SHOWN_TICKS, ScheduleOut};

/// A schedule to add, as the API takes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBody {
    name: String,
    cron: String,
    queue: String,
    #[serde(default)]
    tz: Option<String>,
    #[serde(default)]
    body: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    misfire: Misfire,
    #[serde(default)]
    from: Option<TimeArg>,
    #[serde(default)]
    until: Option<TimeArg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct OwnerBody {
    #[serde(default)]
    owner: Option<String>,
}

/// The routes, for [`super::router`] to put behind the login.
pub(super) fn routes(r: Router<Arc<Api>>) -> Router<Arc<Api>> {
    r.route("/api/v1/schedules", get(list).post(add))
        .route("/api/v1/schedules/{name}", get(show))
        .route("/api/v1/schedules/{name}/{action}", post(steer))
}

/// A failure of [`crate::schedules`] as an answer: no such schedule is 404.
fn refused(e: amqp_delay::Error) -> Response {
    match e {
        amqp_delay::Error::Invalid(m) if m.contains(schedules::NO_SUCH) => error(404, m),
        e @ amqp_delay::Error::Timeout { .. } => error(503, amqp_delay::error_chain(&e)),
        e => failed(&Failure::from(e)),
    }
}

async fn list(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    RawQuery(raw): RawQuery,
) -> Response {
    let page = match params(raw.as_deref(), &["after", "limit"]).and_then(|p| {
        let get = |k: &str| p.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let limit = (get("limit").map(|l| l.parse::<usize>()))
            .transpose()
            .map_err(|_| "'limit' is not a number".to_string())?;
        Page::parse(get("after"), limit).map_err(|e| amqp_delay::error_chain(&e))
    }) {
        Ok(p) => p,
        Err(why) => return error(400, why),
    };
    let (rows, next) = match api.schedules.view(&login.user).await {
        Ok(v) => page.of(&v),
        Err(e) => return refused(e),
    };
    // written as it is (a `json!` value would copy the rows into a tree first)
    #[derive(serde::Serialize)]
    struct ListOut<'a> {
        schedules: &'a [ScheduleOut],
        next: Option<String>,
    }
    let out = ListOut {
        schedules: &rows,
        next,
    };
    json(StatusCode::OK, &out)
}

async fn show(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    UrlPath(name): UrlPath<String>,
    RawQuery(raw): RawQuery,
) -> Response {
    let owner = match params(raw.as_deref(), &["owner"]) {
        Ok(p) => p.into_iter().next().map(|(_, v)| v),
        Err(why) => return error(400, why),
    };
    let v = match api.schedules.view(&login.user).await {
        Ok(v) => v,
        Err(e) => return refused(e),
    };
    let out = match v.get(&name, owner.as_deref()) {
        Ok(e) => ScheduleOut::of(e, now_ms(), SHOWN_TICKS),
        Err(e) => return refused(e),
    };
    drop(v);
    json(StatusCode::OK, &out)
}

async fn add(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    body: Bytes,
) -> Response {
    let b: AddBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(400, format!("the JSON body: {e}")),
    };
    let now = now_ms();
    let times = (
        b.from.map(|t| t.ms(now)).transpose(),
        b.until.map(|t| t.ms(now)).transpose(),
    );
    let (from_ms, until_ms) = match times {
        (Ok(f), Ok(u)) => (f, u),
        (Err(why), _) | (_, Err(why)) => return error(400, why),
    };
    let def = Definition {
        headers: b.headers.into_iter().collect(),
        misfire: b.misfire,
        from_ms,
        until_ms,
        tz: b.tz.unwrap_or_else(|| "UTC".into()),
        ..Definition::new(&b.name, &b.cron, &b.queue, &b.body)
    };
    let books = Books::Live(&api.schedules, &login.user);
    match schedules::add(&login.as_user, books, &def).await {
        Ok(next) => json(
            StatusCode::CREATED,
            &serde_json::json!({ "name": def.name, "next_tick": rfc3339(next) }),
        ),
        Err(e) => refused(e),
    }
}

async fn steer(
    State(api): State<Arc<Api>>,
    Extension(login): Extension<Login>,
    UrlPath((name, action)): UrlPath<(String, String)>,
    body: Bytes,
) -> Response {
    let b: OwnerBody = match body_of(&body) {
        Ok(b) => b,
        Err(why) => return error(400, why),
    };
    let (s, owner) = (&login.as_user, b.owner.as_deref());
    let books = Books::Live(&api.schedules, &login.user);
    let done = match action.as_str() {
        "pause" => schedules::set(s, books, &name, owner, Action::Pause).await,
        "resume" => schedules::set(s, books, &name, owner, Action::Resume).await,
        "remove" => schedules::set(s, books, &name, owner, Action::Remove).await,
        "purge" => schedules::purge(s, books, &name, owner).await,
        "run-now" => {
            return match schedules::run_now(s, books, &name, owner).await {
                Ok(id) => json(StatusCode::OK, &serde_json::json!({ "sent": id })),
                Err(e) => refused(e),
            };
        }
        _ => {
            return error(
                404,
                format!("no action '{action}': pause, resume, remove, run-now or purge"),
            );
        }
    };
    match done {
        Ok(e) => json(
            StatusCode::OK,
            &serde_json::json!({ "owner": e.owner, "name": e.def.name, "done": action }),
        ),
        Err(e) => refused(e),
    }
}
