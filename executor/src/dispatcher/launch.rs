//! Launch planning: admission (on the admission thread), back-off after failures, and
//! spawning a group (run directory, secret, environment, processes, acceptor).
//!
//! Caveat: spawning itself (`fork`/`exec`) runs on the dispatcher thread, which must
//! outlive the ranks for their parent-death signal.

use rankexec_protocol::error_chain as chain;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use rankexec_protocol::Engine;
use rankexec_protocol::env::vars;
use rankexec_protocol::wire::message::Props;
use rankexec_protocol::wire::{Endpoint, Listener, Secret};
use tracing::{debug, info, info_span, warn};

use crate::admission::ledger::Reservation;
use crate::admission::{AdmissionError, Admit, Grant, Refusal};
use crate::config::{LauncherConfig, TransportConfig};
use crate::error::{ExecuteError, StartError};
use crate::group::launch::{self, LaunchPlan};
use crate::group::output::{OutputPump, Tails};
use crate::group::process::{ProcessTable, Role};
use crate::group::rundir::RunDir;
use crate::group::watch::ExitWatcher;
use crate::offload::DropThere;
use crate::os;
use crate::session::accept::{AcceptPolicy, Acceptor, Connected};
use crate::session::link::RankLink;

use super::state::*;

impl Dispatcher {
    pub(super) fn cmd_start(
        &mut self,
        props: Props,
        engine: Option<Arc<dyn Engine>>,
        reply: Sender<Result<(), StartError>>,
    ) {
        self.finalized = false;
        self.start_props = props;
        if let Some(engine) = engine {
            self.engine = Some(Arc::downgrade(&engine));
        }
        if self.group.is_some() {
            let _ = reply.send(Ok(()));
            return;
        }
        self.request_launch(Waiter::Start(reply), false);
    }

    pub(super) fn request_launch(&mut self, waiter: Waiter, after_failure: bool) {
        if let Some(p) = &mut self.pending {
            p.waiters.push(waiter);
            return;
        }
        let mut not_before = Instant::now();
        if after_failure {
            if self.restarts >= self.cfg.restart.max_restarts {
                let last = self
                    .last_failure
                    .clone()
                    .unwrap_or(ExecuteError::Start(StartError::Aborted));
                let err = ExecuteError::RestartsExhausted {
                    restarts: self.restarts,
                    last: Box::new(last),
                };
                match waiter {
                    Waiter::Execute(c) => drop(c.reply.send(Err(err))),
                    other => other.fail(&StartError::Aborted),
                }
                return;
            }
            self.restarts += 1;
            let exp = self.consecutive_failures.saturating_sub(1).min(16);
            let backoff = self
                .cfg
                .restart
                .backoff
                .0
                .saturating_mul(1 << exp)
                .min(self.cfg.restart.max_backoff.0);
            info!(
                restart = self.restarts,
                backoff_ms = backoff.as_millis() as u64,
                "relaunching the rank group"
            );
            not_before += backoff;
        }
        self.pending = Some(PendingLaunch {
            not_before,
            admission_deadline: None,
            in_flight: false,
            attempt: 0,
            waiters: vec![waiter],
        });
        self.check_pending_launch(Instant::now());
    }

    pub(super) fn check_pending_launch(&mut self, now: Instant) {
        if self.finalized {
            // A relaunch decided before finalize (an out-of-memory retry whose teardown
            // finished after it) must not bring a group back.
            if let Some(p) = self.pending.take() {
                for w in p.waiters {
                    w.fail(&StartError::Finalized);
                }
            }
            return;
        }
        let Some(p) = &mut self.pending else { return };
        if !p.in_flight && now < p.not_before {
            return;
        }
        // The admission deadline runs from the first attempt (after any back-off).
        let deadline = *p
            .admission_deadline
            .get_or_insert(now + self.cfg.deadlines.admission.0);
        if p.in_flight {
            if now >= deadline {
                // The attempt is stuck (a ledger lock held by a stopped process): give up;
                // its outcome, if it ever comes, is released on the admission thread.
                let err = StartError::Admission(
                    Refusal {
                        message: "the admission check did not finish (is the reservation ledger locked by a stopped process?)".to_owned(),
                    }
                    .into_error(self.cfg.deadlines.admission.0),
                );
                self.fail_pending(&err);
            }
            return;
        }
        p.in_flight = true;
        self.admission_attempts += 1;
        p.attempt = self.admission_attempts;
        let attempt = p.attempt;
        let (admission, growth, tx) = (self.admission.clone(), self.growth, self.ev_tx.clone());
        self.admit.run(move || {
            let outcome = admission
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .try_admit(growth);
            // Tagged with no group: the outcome belongs to the pending launch.
            let _ = tx.send((0, Report::Admitted { attempt, outcome }));
        });
    }

    pub(super) fn fail_pending(&mut self, err: &StartError) {
        if let Some(p) = self.pending.take() {
            for w in p.waiters {
                w.fail(err);
            }
        }
    }

    /// Releases a reservation on the admission thread (the ledger update takes its lock).
    pub(super) fn release(&self, reservation: Option<Reservation>) {
        drop(reservation.map(|r| DropThere::new(r, &self.admit)));
    }

    pub(super) fn on_admitted(&mut self, attempt: u64, outcome: Result<Admit, AdmissionError>) {
        let now = Instant::now();
        let Some(p) = self
            .pending
            .as_mut()
            .filter(|p| p.in_flight && p.attempt == attempt)
        else {
            // Nobody waits any more (finalized, or the attempt timed out).
            if let Ok(Admit::Granted(grant)) = outcome {
                self.release(grant.reservation);
            }
            return;
        };
        p.in_flight = false;
        match outcome {
            Ok(Admit::Granted(grant)) => {
                let waiters = std::mem::take(&mut p.waiters);
                self.pending = None;
                self.launch_group(grant, waiters);
            }
            Ok(Admit::Wait(refusal)) => {
                let deadline = *p
                    .admission_deadline
                    .get_or_insert(now + self.cfg.deadlines.admission.0);
                if now >= deadline {
                    let err =
                        StartError::Admission(refusal.into_error(self.cfg.deadlines.admission.0));
                    self.fail_pending(&err);
                } else {
                    debug!("waiting for resources: {}", refusal.message);
                    p.not_before = (now + ADMISSION_RETRY).min(deadline);
                }
            }
            Err(e) => self.fail_pending(&StartError::Admission(e)),
        }
    }

    pub(super) fn log_dir(&self) -> PathBuf {
        if let Some(d) = &self.base_log_dir {
            return d.clone();
        }
        if let Some(e) = self.engine.as_ref().and_then(std::sync::Weak::upgrade) {
            return e.workspace().join(&self.cfg.executor_id);
        }
        std::env::temp_dir().join("rankexec-logs").join(format!(
            "{}-{}",
            self.cfg.executor_id,
            os::own_pid()
        ))
    }

    pub(super) fn launch_group(&mut self, mut grant: Grant, waiters: Vec<Waiter>) {
        // Released on the admission thread however this ends.
        let reservation = grant
            .reservation
            .take()
            .map(|r| DropThere::new(Arc::new(r), &self.admit));
        self.generation += 1;
        let generation = self.generation;
        let world = self.cfg.num_of_processes;
        let span = info_span!("group", executor = %self.cfg.executor_id, generation);
        let _enter = span.enter();
        let fail_now = |waiters: Vec<Waiter>, err: StartError| {
            warn!("cannot start the rank group: {}", chain(&err));
            for w in waiters {
                w.fail(&err);
            }
        };
        let log_dir = self.log_dir();
        for r in 0..world {
            if let Err(e) = std::fs::create_dir_all(log_dir.join(format!("rank-{r}"))) {
                return fail_now(
                    waiters,
                    StartError::LogDir {
                        path: log_dir.display().to_string(),
                        source: Arc::new(e),
                    },
                );
            }
            // A stale error file from an earlier group must not be read as this one's.
            let _ = std::fs::remove_file(log_dir.join(format!("rank-{r}/error.json")));
        }
        let (run_dir, listener) = match &self.cfg.transport {
            TransportConfig::Local => {
                let rd = match RunDir::create() {
                    Ok(d) => d,
                    Err(e) => return fail_now(waiters, StartError::RunDir(Arc::new(e))),
                };
                match Listener::bind_local(&rd.socket_path()) {
                    Ok(l) => (Some(rd), l),
                    Err(e) => {
                        return fail_now(
                            waiters,
                            StartError::Listen {
                                endpoint: rd.socket_path().display().to_string(),
                                source: Arc::new(e),
                            },
                        );
                    }
                }
            }
            TransportConfig::Tcp { bind, .. } => match Listener::bind_tcp(bind) {
                Ok(l) => (None, l),
                Err(e) => {
                    return fail_now(
                        waiters,
                        StartError::Listen {
                            endpoint: bind.clone(),
                            source: Arc::new(e),
                        },
                    );
                }
            },
        };
        let mut endpoint = listener.endpoint();
        if let (
            TransportConfig::Tcp {
                advertise: Some(host),
                ..
            },
            Endpoint::Tcp(addr),
        ) = (&self.cfg.transport, &endpoint)
            && let Some((_, port)) = addr.rsplit_once(':')
        {
            endpoint = Endpoint::Tcp(format!("{host}:{port}"));
        }
        let secret = match Secret::generate() {
            Ok(s) => s,
            Err(e) => {
                return fail_now(
                    waiters,
                    StartError::RunDir(Arc::new(std::io::Error::other(e.to_string()))),
                );
            }
        };
        // The launch id is public (it appears in logs); it shares nothing with the secret.
        let launch_id = format!(
            "{}-{generation}-{:08x}",
            os::own_pid(),
            getrandom::u32().unwrap_or(0)
        );
        let table = Arc::new(ProcessTable::default());
        let tx = self.ev_tx.clone();
        let watcher =
            match ExitWatcher::start(table.clone(), tx, move |e| (generation, Report::Exited(e))) {
                Ok(w) => w,
                Err(e) => return fail_now(waiters, StartError::RunDir(Arc::new(e))),
            };
        crate::killswitch::register(&table);

        let master_addr = "127.0.0.1".to_owned();
        // Reserved at admission among this namespace's executors (admission::ports): rank 0
        // binds it only when its code rendezvous, maybe minutes from now.
        let master_port = match &grant.master_port {
            Some(lease) => lease.port(),
            None => portpicker::pick_unused_port().unwrap_or(29500),
        };
        let mut common: BTreeMap<String, String> = BTreeMap::new();
        common.insert(vars::ENDPOINT.into(), endpoint.to_string());
        common.insert(vars::SECRET.into(), secret.to_hex());
        common.insert(vars::LAUNCH_ID.into(), launch_id.clone());
        common.insert(vars::WORLD_SIZE.into(), world.to_string());
        common.insert(vars::LOG_DIR.into(), log_dir.display().to_string());
        common.insert(
            vars::CONNECT_TIMEOUT_MS.into(),
            self.cfg.deadlines.startup.0.as_millis().to_string(),
        );
        common.insert("MASTER_ADDR".into(), master_addr.clone());
        common.insert("MASTER_PORT".into(), master_port.to_string());
        common.extend(grant.common.clone());
        let builtin = matches!(self.cfg.launcher, LauncherConfig::Builtin);
        if let Some(src) = launch::rank_source(&self.cfg.launcher) {
            common.insert(vars::RANK_SOURCE.into(), src.to_owned());
        }
        let mut per_rank = Vec::new();
        if builtin {
            common.insert(vars::PARENT_PID.into(), os::own_pid().to_string());
            for r in 0..world {
                let mut m = BTreeMap::new();
                for (k, v) in [
                    (vars::RANK, r.to_string()),
                    (vars::LOCAL_RANK, r.to_string()),
                    (vars::LOCAL_WORLD_SIZE, world.to_string()),
                    ("RANK", r.to_string()),
                    ("LOCAL_RANK", r.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_WORLD_SIZE", world.to_string()),
                    ("GROUP_RANK", "0".into()),
                    ("GROUP_WORLD_SIZE", "1".into()),
                    ("ROLE_RANK", r.to_string()),
                    ("ROLE_WORLD_SIZE", world.to_string()),
                    ("ROLE_NAME", "default".into()),
                    ("TORCHELASTIC_RUN_ID", launch_id.clone()),
                    ("TORCHELASTIC_RESTART_COUNT", self.restarts.to_string()),
                    (
                        "TORCHELASTIC_MAX_RESTARTS",
                        self.cfg.restart.max_restarts.to_string(),
                    ),
                    (
                        vars::ERROR_FILE,
                        log_dir
                            .join(format!("rank-{r}/error.json"))
                            .display()
                            .to_string(),
                    ),
                ] {
                    m.insert(k.to_owned(), v);
                }
                if let Some(extra) = grant.per_rank.get(r as usize) {
                    m.extend(extra.clone());
                }
                per_rank.push(m);
            }
        }
        let plan = LaunchPlan {
            program: self.program.clone(),
            args: self.cfg.worker.args.clone(),
            world,
            common,
            per_rank,
            env: self.cfg.env.clone(),
            launcher: self.cfg.launcher.clone(),
            master_addr,
            master_port,
            log_dir: log_dir.clone(),
        };
        let epoch = Instant::now();
        let last_seen: Vec<Arc<AtomicU64>> =
            (0..world).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let mut policy = AcceptPolicy::new(
            secret,
            launch_id,
            world,
            vec![None; world as usize],
            self.cfg.deadlines.startup.0.min(Duration::from_secs(10)),
        );
        let deadline = epoch + self.cfg.deadlines.startup.0;
        let mut group = Group {
            generation,
            epoch,
            phase: Phase::Starting {
                deadline,
                waiters,
                init_sent: false,
                acks: vec![false; world as usize],
            },
            table: table.clone(),
            watcher,
            acceptor: None,
            policy: None,
            output: None,
            tails: Arc::new(Tails::default()),
            _run_dir: run_dir,
            links: (0..world).map(|_| RankLink::new()).collect(),
            last_seen,
            external: !builtin,
            closed_pending: BTreeMap::new(),
            unanswering: Default::default(),
            exits_pending: Vec::new(),
            failures: Vec::new(),
            oom_baselines: BTreeMap::new(),
            grant,
            reservation,
            log_dir: log_dir.clone(),
            endpoint: endpoint.to_string(),
            pgid: 0,
        };
        let launched = launch::launch(&plan, &table, &group.watcher);
        // Only this thread adds to the table: one snapshot serves every use below.
        let procs = table.snapshot();
        for p in &procs {
            if let Role::Rank(r) = p.role {
                policy.expect_pid(r, p.pid);
            }
        }
        let policy = Arc::new(policy);
        group.policy = Some(policy.clone());
        let launched = match launched {
            Ok(l) => l,
            Err(e) => {
                self.group = Some(group);
                self.fail_start(e);
                return;
            }
        };
        group.pgid = launched.pgid;
        for p in &procs {
            if let Some(c) = os::oom_kills(p.pid) {
                group.oom_baselines.insert(p.pid, c);
            }
        }
        if let Some(r) = group.reservation.as_ref().and_then(DropThere::get) {
            let pids: Vec<u32> = procs.iter().map(|p| p.pid).collect();
            let r = r.clone();
            self.admit.run(move || r.set_rank_pids(&pids));
        }
        if let Some(p) = &group.grant.placement {
            info!(placement = %p.describe(), "placement");
        }
        match OutputPump::start(
            launched.pipes,
            &log_dir,
            self.cfg.executor_id.clone(),
            self.cfg.max_rank_log.bytes(),
        ) {
            Ok(p) => {
                let tx = self.ev_tx.clone();
                p.tails().notify_closed(move |src| {
                    let _ = tx.send((generation, Report::OutputClosed(src)));
                });
                group.tails = p.tails();
                group.output = Some(p);
            }
            Err(e) => warn!(error = %e, "cannot capture rank output"),
        }
        let tx = self.ev_tx.clone();
        let report: Arc<dyn Fn(Connected) + Send + Sync> =
            Arc::new(move |c| drop(tx.send((generation, Report::Connected(Box::new(c))))));
        match Acceptor::start(listener, policy, report) {
            Ok(a) => group.acceptor = Some(a),
            Err(e) => {
                self.group = Some(group);
                self.fail_start(StartError::Listen {
                    endpoint: endpoint.to_string(),
                    source: Arc::new(e),
                });
                return;
            }
        }
        info!(ranks = world, %endpoint, log_dir = %log_dir.display(), "rank group launched");
        self.group = Some(group);
    }
}
