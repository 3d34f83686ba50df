//! The client's engine: where every event fired on a site goes.
//!
//! `fire_event` calls `handle_event` on each component of the site, in configuration
//! order (executors first). Contexts made by [`ClientEngine::new_context`] start with
//! the site's identity and its sticky properties; [`ClientEngine::keep_sticky`] saves
//! the sticky properties of a finished context for the next ones.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rankexec_protocol::wire::message::Props;
use rankexec_protocol::{
    Engine, EventType, FireEventError, FlComponent, FlContext, PropFlags, keys,
};

/// One site's engine.
pub struct ClientEngine {
    site: String,
    index: usize,
    num_sites: usize,
    job_id: String,
    workspace: PathBuf,
    handlers: OnceLock<Vec<(String, Arc<dyn FlComponent>)>>,
    sticky: Mutex<Props>,
}

impl ClientEngine {
    /// An engine for site `site` (0-based `index` of `num_sites`).
    pub fn new(
        site: &str,
        index: usize,
        num_sites: usize,
        job_id: &str,
        workspace: &Path,
    ) -> Arc<Self> {
        Arc::new(ClientEngine {
            site: site.to_owned(),
            index,
            num_sites,
            job_id: job_id.to_owned(),
            workspace: workspace.to_owned(),
            handlers: OnceLock::new(),
            sticky: Mutex::new(Props::new()),
        })
    }

    /// Sets the components events go to (once).
    pub fn set_handlers(&self, handlers: Vec<(String, Arc<dyn FlComponent>)>) {
        let _ = self.handlers.set(handlers);
    }

    /// A context bound to this engine, with the site's identity and sticky properties.
    pub fn new_context(self: &Arc<Self>) -> FlContext {
        let mut ctx = FlContext::from_props(
            self.sticky
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        );
        ctx.set_engine(self.clone());
        for (k, v) in [
            (
                keys::IDENTITY_NAME,
                rankexec_protocol::Value::from(self.site.as_str()),
            ),
            (keys::JOB_ID, self.job_id.as_str().into()),
            (keys::SITE_INDEX, self.index.into()),
            (keys::NUM_SITES, self.num_sites.into()),
        ] {
            ctx.remove_prop(k);
            let _ = ctx.set_prop(k, v, PropFlags::STICKY);
        }
        ctx
    }

    /// Saves the sticky properties of a finished context.
    pub fn keep_sticky(&self, ctx: &FlContext) {
        let mut s = self.sticky.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, p) in ctx.sticky_props() {
            s.insert(k, p);
        }
    }
}

impl Engine for ClientEngine {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        for (id, h) in self.handlers.get().map(Vec::as_slice).unwrap_or_default() {
            h.handle_event(event, ctx)
                .map_err(|source| FireEventError::Handler {
                    component: id.clone(),
                    event: event.to_string(),
                    source,
                })?;
        }
        Ok(())
    }

    fn identity(&self) -> &str {
        &self.site
    }

    fn job_id(&self) -> &str {
        &self.job_id
    }

    fn workspace(&self) -> &Path {
        &self.workspace
    }
}
