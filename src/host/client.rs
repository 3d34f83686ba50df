//! The client runtime: one site of a federated job.
//!
//! It builds the site's executors from the job (a `MultiProcessExecutor` per rank
//! group, or components run in this process), routes each task by name, fires the
//! lifecycle events (`START_RUN`, `BEFORE_TASK_EXECUTION`, `AFTER_TASK_EXECUTION`,
//! `ABORT_TASK`, `END_RUN`) and turns the controller's aborts into the executor's
//! abort signal (task abort) or a full teardown (job abort, [`ClientRuntime::end`]).
//!
//! A task abort never waits on a round trip: the executor's ranks get `Abort` through
//! the abort signal, and `ABORT_TASK` is fired on the handlers from a thread of its own
//! (see `tell_handlers_of_abort`), so the controller can abort every client at once.

use std::path::Path;
use std::sync::Arc;

use rankexec_executor::MultiProcessExecutor;
use rankexec_protocol::{
    ComponentError, Engine, EventType, Executor, FireEventError, FlComponent, Registry, Shareable,
    Signal, keys,
};
use tracing::info_span;

use super::engine::ClientEngine;
use crate::job::{ExecutorKind, Job};

/// Why a client could not run.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An executor or component could not be built.
    #[error("{site}: cannot build `{id}`")]
    Build {
        /// The site.
        site: String,
        /// The component.
        id: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No executor runs the task.
    #[error("{site}: no executor runs task `{task}`")]
    NoExecutor {
        /// The site.
        site: String,
        /// The task.
        task: String,
    },
    /// An event failed (START_RUN: the rank group could not start).
    #[error("{site}: {event} failed")]
    Event {
        /// The site.
        site: String,
        /// The event.
        event: String,
        /// Why.
        #[source]
        source: Box<FireEventError>,
    },
    /// The task failed.
    #[error("{site}: task `{task}` failed")]
    Task {
        /// The site.
        site: String,
        /// The task.
        task: String,
        /// Why.
        #[source]
        source: ComponentError,
    },
}

impl ClientError {
    /// The failure class of a failed task, if that is what this is.
    pub fn class(&self) -> Option<rankexec_protocol::ErrorClass> {
        match self {
            ClientError::Task { source, .. } => Some(source.class()),
            _ => None,
        }
    }
}

struct Routed {
    tasks: Vec<String>,
    executor: Arc<dyn Executor>,
    group: Option<Arc<MultiProcessExecutor>>,
}

/// Fires `ABORT_TASK` on the site's handlers, on a thread of its own.
///
/// The trigger comes from the controller's thread, which aborts one client after
/// another, and firing the event is a round trip (a `MultiProcessExecutor` delivers it
/// to its ranks and waits for their acknowledgements, up to its event deadline). The
/// task's executor does not need the event to stop: its own subscription to the abort
/// signal has already sent `Abort` to its ranks (the dispatcher sends an abort it has
/// not seen before any later event). The thread ends with the round trip, bounded by
/// the event deadline.
fn tell_handlers_of_abort(engine: Arc<ClientEngine>, site: String) {
    let spawned = std::thread::Builder::new()
        .name("rx-abort-task".to_owned())
        .spawn(move || {
            let _span = info_span!("client", site = %site).entered();
            let mut ctx = engine.new_context();
            if let Err(e) = engine.fire_event(&EventType::ABORT_TASK, &mut ctx) {
                tracing::warn!(
                    "a handler of {}: {}",
                    EventType::ABORT_TASK,
                    rankexec_protocol::error_chain(&e)
                );
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a thread to fire ABORT_TASK; handlers are not told");
    }
}

/// One site.
pub struct ClientRuntime {
    site: String,
    engine: Arc<ClientEngine>,
    executors: Vec<Routed>,
}

impl ClientRuntime {
    /// Builds site `index` of `num_sites` (named `site-{index+1}`) in `workspace`.
    pub fn build(
        job: &Job,
        index: usize,
        num_sites: usize,
        workspace: &Path,
        in_process: &Registry,
    ) -> Result<Self, ClientError> {
        let site = format!("site-{}", index + 1);
        let _span = info_span!("client", site = %site).entered();
        let engine = ClientEngine::new(
            &site,
            index,
            num_sites,
            &job.meta.name,
            &workspace.join(&site),
        );
        let mut executors = Vec::new();
        let mut handlers: Vec<(String, Arc<dyn FlComponent>)> = Vec::new();
        let build_err =
            |id: &str, e: Box<dyn std::error::Error + Send + Sync>| ClientError::Build {
                site: site.clone(),
                id: id.to_owned(),
                source: e,
            };
        for e in &job.executors {
            let (executor, group): (Arc<dyn Executor>, _) = match &e.kind {
                ExecutorKind::MultiProcess(cfg) => {
                    let mpe = Arc::new(
                        MultiProcessExecutor::new((**cfg).clone())
                            .map_err(|x| build_err(&e.id, Box::new(x)))?,
                    );
                    (mpe.clone(), Some(mpe))
                }
                ExecutorKind::InProcess(c) => match in_process
                    .build(c)
                    .map_err(|x| build_err(&e.id, Box::new(x)))?
                {
                    rankexec_protocol::Component::Executor(x) => (x, None),
                    rankexec_protocol::Component::Handler(_) => {
                        return Err(build_err(&e.id, "the component is not an executor".into()));
                    }
                },
            };
            handlers.push((e.id.clone(), executor.clone() as Arc<dyn FlComponent>));
            executors.push(Routed {
                tasks: e.tasks.clone(),
                executor,
                group,
            });
        }
        for c in &job.client_components {
            let built = in_process
                .build(c)
                .map_err(|x| build_err(&c.id, Box::new(x)))?;
            let h: Arc<dyn FlComponent> = match built {
                rankexec_protocol::Component::Executor(x) => x,
                rankexec_protocol::Component::Handler(h) => h,
            };
            handlers.push((c.id.clone(), h));
        }
        engine.set_handlers(handlers);
        Ok(ClientRuntime {
            site,
            engine,
            executors,
        })
    }

    /// The site's name.
    pub fn site(&self) -> &str {
        &self.site
    }

    fn fire(&self, event: &EventType) -> Result<(), ClientError> {
        let mut ctx = self.engine.new_context();
        let r = self.engine.fire_event(event, &mut ctx);
        self.engine.keep_sticky(&ctx);
        r.map_err(|source| ClientError::Event {
            site: self.site.clone(),
            event: event.to_string(),
            source: Box::new(source),
        })
    }

    /// Fires `START_RUN`: rank groups launch.
    pub fn start(&self) -> Result<(), ClientError> {
        let _span = info_span!("client", site = %self.site).entered();
        self.fire(&EventType::START_RUN)
    }

    /// Runs `task` on the executor it is routed to. `abort` is the controller's task
    /// abort: it reaches the executor (and its ranks) as their abort signal.
    pub fn run_task(
        &self,
        task: &str,
        input: Shareable,
        round: u32,
        abort: &Signal,
    ) -> Result<Shareable, ClientError> {
        let _span = info_span!("client", site = %self.site).entered();
        let routed = self
            .executors
            .iter()
            .find(|r| r.tasks.iter().any(|t| t == task))
            .ok_or_else(|| ClientError::NoExecutor {
                site: self.site.clone(),
                task: task.to_owned(),
            })?;
        let mut ctx = self.engine.new_context();
        let _ = ctx.set_prop(keys::TASK_NAME, task, rankexec_protocol::PropFlags::PUBLIC);
        let _ = ctx.set_prop(
            keys::CURRENT_ROUND,
            round,
            rankexec_protocol::PropFlags::PUBLIC,
        );
        let fire = |event: &EventType, ctx: &mut rankexec_protocol::FlContext| {
            self.engine
                .fire_event(event, ctx)
                .map_err(|source| ClientError::Event {
                    site: self.site.clone(),
                    event: event.to_string(),
                    source: Box::new(source),
                })
        };
        fire(&EventType::BEFORE_TASK_EXECUTION, &mut ctx)?;
        let tell_abort = {
            let (engine, site) = (self.engine.clone(), self.site.clone());
            abort.on_trigger(move || tell_handlers_of_abort(engine, site))
        };
        let out = routed
            .executor
            .execute(task, input.with_meta("round", round), &mut ctx, abort)
            .map_err(|source| ClientError::Task {
                site: self.site.clone(),
                task: task.to_owned(),
                source,
            });
        drop(tell_abort);
        fire(&EventType::AFTER_TASK_EXECUTION, &mut ctx)?;
        self.engine.keep_sticky(&ctx);
        out
    }

    /// Stops every rank group to free its resources; the next task relaunches it.
    pub fn park(&self) {
        for r in &self.executors {
            if let Some(g) = &r.group {
                g.park();
            }
        }
    }

    /// Fires `END_RUN`: rank groups receive it, then are torn down.
    pub fn end(&self) -> Result<(), ClientError> {
        let _span = info_span!("client", site = %self.site).entered();
        self.fire(&EventType::END_RUN)
    }

    /// The pids of every rank process of this site.
    pub fn live_pids(&self) -> Vec<u32> {
        self.executors
            .iter()
            .filter_map(|r| r.group.as_ref())
            .flat_map(|g| g.live_pids())
            .collect()
    }
}
