//! `Cleanup`: what a run has declared, so that `main` can delete it on success, error or Ctrl-C.

use std::sync::{Arc, Mutex};

use amqp_delay::{Layout, Result};

use crate::amqp::{connect, delete_exchange, delete_queue, delete_topology};

/// What a run has declared, so it can be deleted on success, error or Ctrl-C. Objects are
/// registered before they are declared; deleting a missing one is harmless.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cleanup {
    inner: Arc<Mutex<Registered>>,
    /// What the run declared on other brokers (the plugin's), by URL.
    elsewhere: Arc<Mutex<Vec<(String, Cleanup)>>>,
}

#[derive(Debug, Default)]
struct Registered {
    layouts: Vec<Layout>,
    queues: Vec<String>,
    exchanges: Vec<String>,
    /// Every exchange ever registered, deleted or not: a scenario's teardown may delete these.
    declared: Vec<String>,
}

impl Cleanup {
    /// What the run declares on the broker at `url`, another than the run's own: deleted by
    /// [`Cleanup::run`] over a connection to `url`.
    pub(crate) fn at(&self, url: &str) -> Cleanup {
        let mut g = self.elsewhere.lock().expect("cleanup");
        if let Some((_, c)) = g.iter().find(|(u, _)| u == url) {
            return c.clone();
        }
        let c = Cleanup::default();
        g.push((url.to_string(), c.clone()));
        c
    }
    pub(crate) fn add_layout(&self, l: &Layout) {
        self.inner.lock().expect("cleanup").layouts.push(l.clone());
    }
    pub(crate) fn add_queue(&self, q: &str) {
        self.inner
            .lock()
            .expect("cleanup")
            .queues
            .push(q.to_string());
    }
    pub(crate) fn add_exchange(&self, x: &str) {
        let mut g = self.inner.lock().expect("cleanup");
        g.exchanges.push(x.to_string());
        g.declared.push(x.to_string());
    }
    /// Every exchange this run registered, also those deleted since (a gateway stage deletes
    /// its own as it ends, but its pair stays in the control stream).
    pub(crate) fn declared_exchanges(&self) -> Vec<String> {
        self.inner.lock().expect("cleanup").declared.clone()
    }
    /// `layout` was deleted already.
    pub(crate) fn forget_layout(&self, l: &Layout) {
        self.inner
            .lock()
            .expect("cleanup")
            .layouts
            .retain(|x| x.prefix() != l.prefix());
    }
    /// `q` was deleted already.
    pub(crate) fn forget_queue(&self, q: &str) {
        self.inner
            .lock()
            .expect("cleanup")
            .queues
            .retain(|x| x != q);
    }
    /// `x` was deleted already.
    pub(crate) fn forget_exchange(&self, x: &str) {
        self.inner
            .lock()
            .expect("cleanup")
            .exchanges
            .retain(|e| e != x);
    }
    /// Deletes every registered queue, exchange and topology (over a fresh connection to
    /// `url`), then what was registered on other brokers.
    pub(crate) async fn run(&self, url: &str) -> Result<()> {
        let mut result = self.run_here(url).await;
        let elsewhere = self.elsewhere.lock().expect("cleanup").clone();
        for (url, c) in elsewhere {
            if let Err(e) = Box::pin(c.run(&url)).await {
                result = Err(e);
            }
        }
        result
    }

    async fn run_here(&self, url: &str) -> Result<()> {
        let (layouts, queues, exchanges, declared) = {
            let g = self.inner.lock().expect("cleanup");
            let (l, q, x) = (&g.layouts, &g.queues, &g.exchanges);
            (l.clone(), q.clone(), x.clone(), g.declared.clone())
        };
        if layouts.is_empty() && queues.is_empty() && exchanges.is_empty() {
            return Ok(());
        }
        let conn = connect(url, "delay-bench cleanup").await?;
        let mut result = Ok(());
        for q in &queues {
            if let Err(e) = delete_queue(&conn, q).await {
                result = Err(e);
            }
        }
        for x in &exchanges {
            if let Err(e) = delete_exchange(&conn, x).await {
                result = Err(e);
            }
        }
        for l in &layouts {
            if let Err(e) = delete_topology(&conn, l, &declared).await {
                result = Err(e);
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        if result.is_ok() {
            let mut g = self.inner.lock().expect("cleanup");
            *g = Registered::default();
        }
        result
    }
}
