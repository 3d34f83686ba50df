//! The worker binary of the guide's "Rust ranks" section (docs/rank-code.md), verbatim
//! below this comment: `cargo test` builds it and clippy lints it, so that section
//! cannot go stale (python/tests/test_docs.py checks the page holds this text).

use rankexec_protocol::{
    ComponentError, Executor, FlComponent, FlContext, Shareable, Signal, keys,
};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    steps: u32,
}

struct Trainer {
    steps: u32,
}

impl FlComponent for Trainer {}

impl Executor for Trainer {
    fn execute(
        &self,
        _task: &str,
        _input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = ctx
            .get_prop(keys::RANK_NUMBER)
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        for _ in 0..self.steps {
            if abort.is_triggered() {
                return Err(ComponentError::aborted());
            }
            // ... one step on this rank's shard; a fallible allocation that fails is
            // Err(ComponentError::out_of_memory(..)), which the executor may retry ...
        }
        Ok(Shareable::new()
            .with_meta("rank", rank)
            .with_meta("num_samples", 1000))
    }
}

fn main() -> std::process::ExitCode {
    let mut registry = rankexec_sub_worker::builtins::registry(); // optional
    registry.executor("Trainer", |a: Args| Ok(Trainer { steps: a.steps }));
    rankexec_sub_worker::main(registry)
}
