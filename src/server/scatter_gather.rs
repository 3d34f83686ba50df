//! `ScatterAndGather`: the FedAvg controller.
//!
//! Each round it sends the global model to every client as the training task, waits for
//! their results up to `train_timeout`, averages the models weighted by each client's
//! `aggregation_weight` (its sample count), persists the new global model, and records
//! the round's metrics (the same weighted mean of every numeric result). After the last
//! round it can run a validation task on the final model for the final metrics.
//!
//! Memory does not grow with the number of rounds: each round's report goes to the
//! [`Observer`] (the simulator streams it to a JSON-lines file) and the outcome keeps
//! only the last [`KEEP_ROUNDS`].
//!
//! Aborts, all ending with every client's rank groups torn down by the caller:
//! - a client past `train_timeout` has its task aborted (its executor tells its ranks,
//!   and kills them if they do not stop); the round goes on without it;
//! - fewer than `min_clients` results in a round ends the job: `aborted` when clients
//!   timed out or were aborted, `failed` when a client failed (its error is the reason);
//! - the job abort signal (Ctrl-C, or [`ScatterAndGather::run`]'s caller) aborts every
//!   task in flight and ends the job as `aborted`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use rankexec_executor::result::{Weighted, weight_of, weighted_average};
use rankexec_protocol::{ErrorClass, Shareable, Signal, Value};
use serde::Serialize;
use tracing::{info, warn};

use super::persistor::{ModelPersistor, TENSOR_SHAPES};
use crate::job::model::ScatterAndGatherArgs;

/// A global-model blob at least this large is built in sealed shared memory.
const SHARED_FROM: usize = 64 << 10;

/// How long a client may take to return after its task was aborted, before the
/// controller stops waiting for it and leaves it behind (a multi-process executor is
/// bounded well below this; an in-process executor that ignores its abort is not).
const ABORT_WAIT: Duration = Duration::from_secs(120);

/// How many of the last rounds an [`Outcome`] keeps.
pub const KEEP_ROUNDS: usize = 10;

/// How a client's task ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TaskStatus {
    /// It returned a result.
    Ok {
        /// The client's numeric results (its result's metadata).
        metrics: BTreeMap<String, f64>,
        /// How long the client took.
        seconds: f64,
    },
    /// It did not return within the timeout and was aborted.
    TimedOut {
        /// The timeout.
        after_secs: f64,
    },
    /// It was aborted with the job.
    Aborted,
    /// It failed.
    Failed {
        /// The failure class.
        class: String,
        /// The error.
        error: String,
        /// How long the client took.
        seconds: f64,
    },
}

/// The numeric metadata of a client's result (its metrics), `round` aside.
fn client_metrics(s: &Shareable) -> BTreeMap<String, f64> {
    s.meta_map()
        .iter()
        .filter(|(k, _)| k.as_str() != "round")
        .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
        .collect()
}

/// A client taking part in the job.
pub trait FedClient: Send + Sync {
    /// The site name.
    fn name(&self) -> &str;
    /// Runs `task`; must return soon after `abort` fires.
    fn run(
        &self,
        task: &str,
        input: Shareable,
        round: u32,
        abort: &Signal,
        obs: &dyn Observer,
    ) -> Result<Shareable, (ErrorClass, String)>;
}

/// What a client is doing, for progress displays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    /// Waiting for a place to run its rank group.
    Queued,
    /// Running the task.
    Running,
    /// Done (successfully or not).
    Done,
}

/// Receives progress (from the controller's thread and every client's).
pub trait Observer: Send + Sync {
    /// A phase started (`round N` or `validate`) with this many clients.
    fn phase_started(&self, _phase: &str, _round: u32, _rounds: u32, _clients: usize) {}
    /// A client changed state.
    fn client_state(&self, _site: &str, _state: ClientState) {}
    /// A round ended.
    fn round_done(&self, _report: &RoundReport) {}
}

/// One round.
#[derive(Debug, Clone, Serialize)]
pub struct RoundReport {
    /// The round, from 1.
    pub round: u32,
    /// Each client's outcome.
    pub clients: BTreeMap<String, TaskStatus>,
    /// Weighted means of the clients' numeric results, plus `clients` (how many
    /// contributed).
    pub metrics: BTreeMap<String, f64>,
    /// Wall time.
    pub seconds: f64,
}

/// How the job ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Every round ran.
    Completed,
    /// Aborted (timeouts, too few clients, or asked to).
    Aborted,
    /// A client failed and too few remained.
    Failed,
    /// Interrupted twice (Ctrl-C or SIGTERM): every rank was killed at once.
    Interrupted,
}

/// The controller's result.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// How the job ended.
    pub status: JobStatus,
    /// Why, when not completed.
    pub reason: Option<String>,
    /// How many rounds ran (the last one included, even when it failed).
    pub rounds_run: u32,
    /// The last [`KEEP_ROUNDS`] rounds (every round went to the observer).
    pub rounds: Vec<RoundReport>,
    /// The final model's metrics (the validation task's weighted means).
    pub final_metrics: Option<BTreeMap<String, f64>>,
    /// The final model.
    #[serde(skip)]
    pub model: Shareable,
}

/// The FedAvg workflow.
pub struct ScatterAndGather {
    args: ScatterAndGatherArgs,
    persistor: Option<ModelPersistor>,
    job: String,
    abort_wait: Duration,
}

struct Scattered {
    ok: Vec<(String, Shareable)>,
    statuses: BTreeMap<String, TaskStatus>,
}

fn weighted_metrics(results: &[(String, Shareable)], weight_key: &str) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (_, s) in results {
        let w = s.meta(weight_key).and_then(Value::as_f64).unwrap_or(1.0);
        for (k, v) in s.meta_map() {
            if k == weight_key || k == "round" {
                continue;
            }
            if let Some(x) = v.as_f64() {
                let e = sums.entry(k.clone()).or_default();
                e.0 += x * w;
                e.1 += w;
            }
        }
    }
    let mut m: BTreeMap<String, f64> = sums
        .into_iter()
        .filter(|(_, (_, w))| *w > 0.0)
        .map(|(k, (s, w))| (k, s / w))
        .collect();
    let total: f64 = results
        .iter()
        .filter_map(|(_, s)| s.meta(weight_key).and_then(Value::as_f64))
        .sum();
    m.insert(weight_key.to_owned(), total);
    m.insert("clients".to_owned(), results.len() as f64);
    m
}

impl ScatterAndGather {
    /// A controller with these settings.
    pub fn new(args: ScatterAndGatherArgs, persistor: Option<ModelPersistor>, job: &str) -> Self {
        ScatterAndGather {
            args,
            persistor,
            job: job.to_owned(),
            abort_wait: ABORT_WAIT,
        }
    }

    /// Sends `task` to every client and collects what comes back in time.
    fn scatter(
        &self,
        task: &str,
        input: &Shareable,
        round: u32,
        clients: &[Arc<dyn FedClient>],
        job_abort: &Signal,
        obs: &Arc<dyn Observer>,
    ) -> Scattered {
        let timeout = self.args.train_timeout.0;
        let (tx, rx) = crossbeam_channel::unbounded();
        let aborts: Vec<Signal> = clients.iter().map(|_| Signal::new()).collect();
        // A job abort aborts every task in flight.
        let _subs: Vec<_> = aborts
            .iter()
            .map(|a| {
                let a = a.clone();
                let j = job_abort.clone();
                job_abort.on_trigger(move || a.trigger(j.reason().unwrap_or_default()))
            })
            .collect();
        let mut statuses = BTreeMap::new();
        let mut ok = Vec::new();
        // Detached threads, not scoped ones: a client that never returns (an in-process
        // executor ignoring its abort) is left behind after `abort_wait` instead of
        // holding the job forever. Its late result goes to a closed channel.
        for (i, c) in clients.iter().enumerate() {
            let (tx, abort, input) = (tx.clone(), aborts[i].clone(), input.clone());
            let (c, obs, task) = (c.clone(), obs.clone(), task.to_owned());
            let spawned = std::thread::Builder::new()
                .name(format!("rx-client-{i}"))
                .spawn({
                    let tx = tx.clone();
                    move || {
                        let started = Instant::now();
                        let r = c.run(&task, input, round, &abort, obs.as_ref());
                        obs.client_state(c.name(), ClientState::Done);
                        let _ = tx.send((i, r, started.elapsed()));
                    }
                });
            if let Err(e) = spawned {
                let r = Err((
                    ErrorClass::Exception,
                    format!("cannot start the client's thread: {e}"),
                ));
                let _ = tx.send((i, r, Duration::ZERO));
            }
        }
        drop(tx);
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<bool> = vec![true; clients.len()];
        let mut timed_out: Vec<bool> = vec![false; clients.len()];
        let mut hard_deadline = None;
        while pending.iter().any(|p| *p) {
            let wait_until = hard_deadline.unwrap_or(deadline);
            match rx.recv_deadline(wait_until) {
                Ok((i, r, elapsed)) => {
                    pending[i] = false;
                    let name = clients[i].name().to_owned();
                    let seconds = elapsed.as_secs_f64();
                    match r {
                        Ok(s) => {
                            statuses.insert(
                                name.clone(),
                                TaskStatus::Ok {
                                    metrics: client_metrics(&s),
                                    seconds,
                                },
                            );
                            ok.push((name, s));
                        }
                        Err(_) if timed_out[i] => {
                            statuses.insert(
                                name,
                                TaskStatus::TimedOut {
                                    after_secs: timeout.as_secs_f64(),
                                },
                            );
                        }
                        Err((ErrorClass::Aborted, _)) if job_abort.is_triggered() => {
                            statuses.insert(name, TaskStatus::Aborted);
                        }
                        Err((class, error)) => {
                            warn!(site = %name, task, "{error}");
                            statuses.insert(
                                name,
                                TaskStatus::Failed {
                                    class: class.to_string(),
                                    error,
                                    seconds,
                                },
                            );
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) if hard_deadline.is_none() => {
                    for (i, p) in pending.iter().enumerate() {
                        if *p {
                            warn!(
                                site = clients[i].name(),
                                task, "no result within {timeout:?}; aborting the task"
                            );
                            timed_out[i] = true;
                            aborts[i].trigger(format!("task `{task}` timed out after {timeout:?}"));
                        }
                    }
                    hard_deadline = Some(Instant::now() + self.abort_wait);
                }
                Err(_) => {
                    // Clients that ignore even their executor's bounds are left behind
                    // (their threads are detached).
                    for (i, p) in pending.iter().enumerate() {
                        if *p {
                            statuses.insert(
                                clients[i].name().to_owned(),
                                TaskStatus::TimedOut {
                                    after_secs: timeout.as_secs_f64(),
                                },
                            );
                        }
                    }
                    break;
                }
            }
        }
        ok.sort_by(|a, b| a.0.cmp(&b.0));
        Scattered { ok, statuses }
    }

    fn too_few(
        &self,
        round: u32,
        task: &str,
        total: usize,
        s: &Scattered,
        job_abort: &Signal,
    ) -> (JobStatus, String) {
        if let Some(reason) = job_abort.reason() {
            return (JobStatus::Aborted, reason);
        }
        let mut parts = Vec::new();
        let mut failed = false;
        for (site, st) in &s.statuses {
            match st {
                TaskStatus::Ok { .. } => {}
                TaskStatus::TimedOut { after_secs } => parts.push(format!(
                    "{site}: task `{task}` timed out after {after_secs} s and was aborted"
                )),
                TaskStatus::Aborted => parts.push(format!("{site}: task `{task}` aborted")),
                TaskStatus::Failed { error, .. } => {
                    failed = true;
                    parts.push(format!("{site}: {error}"));
                }
            }
        }
        let status = if failed {
            JobStatus::Failed
        } else {
            JobStatus::Aborted
        };
        (
            status,
            format!(
                "round {round}: {} of {total} clients returned a result, min_clients is {} ({})",
                s.ok.len(),
                self.args.min_clients,
                parts.join("; ")
            ),
        )
    }

    /// Runs every round. The caller ends the clients (END_RUN) afterwards, whatever the
    /// outcome.
    pub fn run(
        &self,
        clients: &[Arc<dyn FedClient>],
        job_abort: &Signal,
        obs: &Arc<dyn Observer>,
    ) -> Outcome {
        let mut global = Shareable::new();
        let mut rounds = Rounds::default();
        let total = clients.len();
        let ended = |status, reason, rounds: Rounds, model| Outcome {
            status,
            reason: Some(reason),
            rounds_run: rounds.run,
            rounds: rounds.last.into(),
            final_metrics: None,
            model,
        };
        for round in 1..=self.args.num_rounds {
            if let Some(reason) = job_abort.reason() {
                return ended(JobStatus::Aborted, reason, rounds, global);
            }
            obs.phase_started("round", round, self.args.num_rounds, total);
            let started = Instant::now();
            let input = global.clone().with_meta("round", round);
            let s = self.scatter(
                &self.args.train_task,
                &input,
                round,
                clients,
                job_abort,
                obs,
            );
            if job_abort.is_triggered() || s.ok.len() < self.args.min_clients as usize {
                let (status, reason) =
                    self.too_few(round, &self.args.train_task, total, &s, job_abort);
                let report = RoundReport {
                    round,
                    clients: s.statuses,
                    metrics: BTreeMap::new(),
                    seconds: started.elapsed().as_secs_f64(),
                };
                obs.round_done(&report);
                rounds.push(report);
                return ended(status, reason, rounds, global);
            }
            let key = &self.args.aggregation_weight;
            let names: Vec<String> = match &self.args.aggregate {
                Some(n) => n.clone(),
                None => s.ok[0].1.blobs().keys().cloned().collect(),
            };
            let parts: Result<Vec<Weighted<'_>>, _> =
                s.ok.iter()
                    .map(|(site, sh)| {
                        Ok(Weighted {
                            who: site,
                            weight: weight_of(site, sh, key)?,
                            shareable: sh,
                        })
                    })
                    .collect();
            // Written straight into shared memory when large: every client's executor
            // then hands the same sealed pages to all of its ranks, with no copy.
            let averaged = match parts.and_then(|p| weighted_average(&p, &names, SHARED_FROM)) {
                Ok(a) => a,
                Err(e) => {
                    return ended(
                        JobStatus::Failed,
                        format!("round {round}: cannot aggregate: {e}"),
                        rounds,
                        global,
                    );
                }
            };
            let mut next = Shareable::new();
            for (name, bytes) in averaged {
                next.set_blob(name, bytes);
            }
            // The tensors' shapes, as the first client declared them, travel with the model.
            if let Some(shapes) = s.ok[0].1.meta(TENSOR_SHAPES) {
                next.set_meta(TENSOR_SHAPES, shapes.clone());
            }
            global = next;
            if let Some(p) = &self.persistor
                && let Err(e) = p.save(&global, round, &self.job)
            {
                return ended(
                    JobStatus::Failed,
                    format!("cannot write the model to {}: {e}", p.path().display()),
                    rounds,
                    global,
                );
            }
            let report = RoundReport {
                round,
                clients: s.statuses,
                metrics: weighted_metrics(&s.ok, key),
                seconds: started.elapsed().as_secs_f64(),
            };
            info!(round, metrics = ?report.metrics, "round done");
            obs.round_done(&report);
            rounds.push(report);
        }
        let mut final_metrics = None;
        if let Some(task) = &self.args.validate_task {
            obs.phase_started(
                "validate",
                self.args.num_rounds,
                self.args.num_rounds,
                total,
            );
            let s = self.scatter(task, &global, self.args.num_rounds, clients, job_abort, obs);
            if job_abort.is_triggered() || s.ok.len() < self.args.min_clients as usize {
                let (status, reason) =
                    self.too_few(self.args.num_rounds, task, total, &s, job_abort);
                return ended(status, reason, rounds, global);
            }
            final_metrics = Some(weighted_metrics(&s.ok, "num_samples"));
        }
        Outcome {
            status: JobStatus::Completed,
            reason: None,
            rounds_run: rounds.run,
            rounds: rounds.last.into(),
            final_metrics,
            model: global,
        }
    }
}

/// The rounds an outcome keeps: a count and the last [`KEEP_ROUNDS`].
#[derive(Default)]
struct Rounds {
    run: u32,
    last: VecDeque<RoundReport>,
}

impl Rounds {
    fn push(&mut self, r: RoundReport) {
        self.run += 1;
        if self.last.len() == KEEP_ROUNDS {
            self.last.pop_front();
        }
        self.last.push_back(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Quiet;
    impl Observer for Quiet {}

    /// Returns a one-float model at once.
    struct Prompt;
    impl FedClient for Prompt {
        fn name(&self) -> &str {
            "site-1"
        }
        fn run(
            &self,
            _: &str,
            _: Shareable,
            _: u32,
            _: &Signal,
            _: &dyn Observer,
        ) -> Result<Shareable, (ErrorClass, String)> {
            Ok(Shareable::new()
                .with_blob("w", 1.0f32.to_le_bytes().to_vec())
                .with_meta("num_samples", 1))
        }
    }

    /// Never returns, abort or not (an in-process executor stuck in a loop).
    struct Stuck(crossbeam_channel::Receiver<()>);
    impl FedClient for Stuck {
        fn name(&self) -> &str {
            "site-2"
        }
        fn run(
            &self,
            _: &str,
            _: Shareable,
            _: u32,
            _: &Signal,
            _: &dyn Observer,
        ) -> Result<Shareable, (ErrorClass, String)> {
            let _ = self.0.recv();
            Err((ErrorClass::Exception, "released".to_owned()))
        }
    }

    #[test]
    fn a_client_that_never_returns_is_left_behind() {
        let args: ScatterAndGatherArgs = serde_json::from_value(serde_json::json!({
            "num_rounds": 1, "min_clients": 1, "train_timeout": "100ms"
        }))
        .unwrap();
        let mut sg = ScatterAndGather::new(args, None, "job");
        sg.abort_wait = Duration::from_millis(200);
        let (release, stuck) = crossbeam_channel::bounded::<()>(0);
        let clients: Vec<Arc<dyn FedClient>> = vec![Arc::new(Prompt), Arc::new(Stuck(stuck))];
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let obs: Arc<dyn Observer> = Arc::new(Quiet);
            let _ = tx.send(sg.run(&clients, &Signal::new(), &obs));
        });
        let outcome = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the job ended without the stuck client");
        assert_eq!(outcome.status, JobStatus::Completed, "{outcome:?}");
        let round = &outcome.rounds[0];
        assert!(
            matches!(round.clients["site-1"], TaskStatus::Ok { .. }),
            "{round:?}"
        );
        assert!(
            matches!(round.clients["site-2"], TaskStatus::TimedOut { .. }),
            "{round:?}"
        );
        // Let the stuck thread end.
        drop(release);
    }
}
