//! `Cleanup`: what a run has declared, so that `main` can delete it on success, error or Ctrl-C.

use std::sync::{Arc, Mutex};

use amqp_delay::{Layout, Result, Topology};

use crate::amqp::{connect, delete_queue};

/// What a run has declared, so it can be deleted on success, error or Ctrl-C. Objects are
/// registered before they are declared; deleting a missing one is harmless.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cleanup {
    inner: Arc<Mutex<(Vec<Layout>, Vec<String>)>>,
}

impl Cleanup {
    pub(crate) fn add_layout(&self, l: &Layout) {
        self.inner.lock().expect("cleanup").0.push(l.clone());
    }
    pub(crate) fn add_queue(&self, q: &str) {
        self.inner.lock().expect("cleanup").1.push(q.to_string());
    }
    /// `layout` was deleted already.
    pub(crate) fn forget_layout(&self, l: &Layout) {
        self.inner
            .lock()
            .expect("cleanup")
            .0
            .retain(|x| x.prefix() != l.prefix());
    }
    /// `q` was deleted already.
    pub(crate) fn forget_queue(&self, q: &str) {
        self.inner.lock().expect("cleanup").1.retain(|x| x != q);
    }
    /// Deletes every registered queue and topology (over a fresh connection).
    pub(crate) async fn run(&self, url: &str) -> Result<()> {
        let (layouts, queues) = self.inner.lock().expect("cleanup").clone();
        if layouts.is_empty() && queues.is_empty() {
            return Ok(());
        }
        let conn = connect(url, "delay-bench cleanup").await?;
        let mut result = Ok(());
        for q in &queues {
            if let Err(e) = delete_queue(&conn, q).await {
                result = Err(e);
            }
        }
        for l in &layouts {
            if let Err(e) = Topology::new(l.clone()).delete(&conn).await {
                result = Err(e);
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        if result.is_ok() {
            let mut g = self.inner.lock().expect("cleanup");
            g.0.clear();
            g.1.clear();
        }
        result
    }
}
