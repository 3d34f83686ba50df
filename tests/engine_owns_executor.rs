//! A host's engine usually owns its executors, and the executor keeps the engine to relay
//! events. Dropping the host without END_RUN must still tear the group down: the
//! executor holds the engine weakly, so there is no cycle to keep it alive.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Engine, EventType, FireEventError, FlComponent, FlContext};

struct HostEngine {
    executors: Mutex<Vec<Arc<MultiProcessExecutor>>>,
    workspace: PathBuf,
}

impl Engine for HostEngine {
    fn fire_event(&self, _: &EventType, _: &mut FlContext) -> Result<(), FireEventError> {
        Ok(())
    }
    fn identity(&self) -> &str {
        "site-1"
    }
    fn job_id(&self) -> &str {
        "job"
    }
    fn workspace(&self) -> &Path {
        &self.workspace
    }
}

#[test]
fn dropping_a_host_that_owns_its_executor_ends_the_group() {
    let logs = tempfile::tempdir().unwrap();
    let exec = Arc::new(
        MultiProcessExecutor::new(config(2, "Echo", serde_json::json!({}), logs.path())).unwrap(),
    );
    let engine = Arc::new(HostEngine {
        executors: Mutex::new(vec![exec.clone()]),
        workspace: logs.path().to_owned(),
    });
    let mut ctx = FlContext::with_engine(engine.clone());
    exec.handle_event(&EventType::START_RUN, &mut ctx).unwrap();
    let pids = exec.live_pids();
    assert_eq!(pids.len(), 2);
    assert_eq!(engine.executors.lock().unwrap().len(), 1);
    // The host goes away without END_RUN: its context, its engine, its executor handle.
    drop(ctx);
    drop(exec);
    drop(engine);
    assert_gone(&pids, "after the host dropped everything");
}
