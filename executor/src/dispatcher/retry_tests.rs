//! `restart.retry_task` transitions, driven without processes (see `tests`): a rank's
//! error is held briefly for a death to retry on, a death from outside retries the task
//! with its cause recorded, and anything else answers as before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rankexec_protocol::{ErrorClass, Signal};

use super::state::*;
use super::tests::{answer, dispatcher, ready_group, result, sent_task};
use crate::error::{ExecuteError, FailureCause, RankFailure};
use crate::os::ExitStatus;

fn with_retries(n: u32, retries: u32) -> Dispatcher {
    let mut d = dispatcher(n);
    let mut cfg = (*d.cfg).clone();
    cfg.restart.retry_task = retries;
    d.cfg = Arc::new(cfg);
    d
}

fn death(rank: u32, cause: FailureCause) -> RankFailure {
    RankFailure {
        rank,
        pid: Some(4242),
        cause,
        stderr_tail: Vec::new(),
        error_file: None,
        after: Duration::ZERO,
    }
}

const SIGKILL: FailureCause = FailureCause::Exited(ExitStatus::Signal {
    signal: 9,
    core_dumped: false,
});

#[test]
fn an_error_then_a_death_retries_the_task_naming_the_death() {
    let mut d = with_retries(2, 2);
    let generation = ready_group(&mut d);
    let abort = Signal::new();
    let (rx, id) = sent_task(&mut d, &abort);
    // Rank 0 fails in a collective because its peer died; rank 1 never answers.
    result(&mut d, generation, 0, id, ErrorClass::Exception);
    result(&mut d, generation, 1, id, ErrorClass::Aborted);
    assert!(rx.try_recv().is_err(), "held for a death");
    assert!(d.task.as_ref().is_some_and(|t| t.settle.is_some()));
    d.fail_group(death(1, SIGKILL));
    // The group is gone (no processes); the task waits for the relaunch.
    assert!(d.group.is_none());
    d.drain_queue();
    let retried = d.pending.as_ref().and_then(|p| {
        p.waiters.iter().find_map(|w| match w {
            Waiter::Execute(c) => Some(c.reply.retries.clone()),
            Waiter::Start(_) => None,
        })
    });
    let retried = retried.expect("the task waits for the relaunch");
    assert_eq!(retried.len(), 1);
    assert_eq!((retried[0].attempt, retried[0].failure.rank), (1, 1));
    assert!(rx.try_recv().is_err(), "not answered yet");
    // Aborted while it waits for the relaunch: the answer still names the retry.
    abort.trigger("stop");
    d.answer_aborted_waiting();
    let err = answer(&rx).unwrap_err();
    let ExecuteError::Retried { retries, last } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(retries.len(), 1);
    assert!(matches!(**last, ExecuteError::Aborted { .. }), "{last:?}");
    assert!(d.pending.is_none(), "nobody waits for the launch any more");
}

#[test]
fn an_error_no_death_follows_is_answered_after_the_grace() {
    let mut d = with_retries(2, 2);
    let generation = ready_group(&mut d);
    let (rx, id) = sent_task(&mut d, &Signal::new());
    result(&mut d, generation, 0, id, ErrorClass::Exception);
    result(&mut d, generation, 1, id, ErrorClass::Aborted);
    assert!(rx.try_recv().is_err());
    d.on_timers(Instant::now() + SETTLE_GRACE + Duration::from_millis(1));
    let err = answer(&rx).unwrap_err();
    assert!(
        matches!(&err, ExecuteError::RankFailed { failure, .. } if failure.rank == 0 && failure.class() == ErrorClass::Exception),
        "{err:?}"
    );
    assert!(
        d.group
            .as_ref()
            .is_some_and(|g| matches!(g.phase, Phase::Ready))
    );
}

#[test]
fn without_retries_an_error_is_answered_at_once_and_a_death_fails_the_task() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let (rx, id) = sent_task(&mut d, &Signal::new());
    result(&mut d, generation, 0, id, ErrorClass::Exception);
    result(&mut d, generation, 1, id, ErrorClass::Aborted);
    assert!(matches!(answer(&rx), Err(ExecuteError::RankFailed { .. })));
    let (rx, _) = sent_task(&mut d, &Signal::new());
    d.fail_group(death(1, SIGKILL));
    let err = answer(&rx).unwrap_err();
    assert!(
        matches!(&err, ExecuteError::RankFailed { failure, .. } if failure.rank == 1),
        "{err:?}"
    );
}

#[test]
fn a_fault_or_exit_code_is_not_retried() {
    for cause in [
        FailureCause::Exited(ExitStatus::Signal {
            signal: 11,
            core_dumped: true,
        }),
        FailureCause::Exited(ExitStatus::Code(1)),
    ] {
        let mut d = with_retries(2, 2);
        ready_group(&mut d);
        let (rx, _) = sent_task(&mut d, &Signal::new());
        d.fail_group(death(1, cause.clone()));
        let err = answer(&rx).unwrap_err();
        assert!(
            matches!(&err, ExecuteError::RankFailed { .. }),
            "{cause:?}: {err:?}"
        );
    }
}

#[test]
fn what_counts_as_a_death_from_outside() {
    use rankexec_protocol::wire::Channel;
    let outside = |c: FailureCause| death(0, c).from_outside();
    assert!(outside(SIGKILL));
    assert!(outside(FailureCause::Exited(ExitStatus::Signal {
        signal: 15,
        core_dumped: false
    })));
    assert!(outside(FailureCause::OomKilled));
    assert!(outside(FailureCause::ConnectionClosed(Channel::Exec)));
    assert!(outside(FailureCause::Unresponsive(Duration::from_secs(10))));
    for fault in [4, 5, 6, 7, 8, 11, 31] {
        assert!(!outside(FailureCause::Exited(ExitStatus::Signal {
            signal: fault,
            core_dumped: true
        })));
    }
    assert!(!outside(FailureCause::Exited(ExitStatus::Code(3))));
}

#[test]
fn a_closed_connection_after_a_reported_error_is_its_consequence() {
    use rankexec_protocol::wire::Channel;
    let mut d = with_retries(2, 2);
    let generation = ready_group(&mut d);
    let (rx, id) = sent_task(&mut d, &Signal::new());
    result(&mut d, generation, 0, id, ErrorClass::Exception);
    result(&mut d, generation, 1, id, ErrorClass::Aborted);
    assert!(rx.try_recv().is_err(), "held for a death");
    // An external launcher stops rank 1 after rank 0's error: not a cause.
    d.fail_group(death(1, FailureCause::ConnectionClosed(Channel::Exec)));
    let err = answer(&rx).unwrap_err();
    assert!(
        matches!(&err, ExecuteError::RankFailed { failure, .. } if failure.rank == 1),
        "{err:?}"
    );
    assert!(d.pending.is_none() && d.queue.is_empty(), "no retry");
}

#[test]
fn a_death_between_tasks_does_not_use_the_next_tasks_retries() {
    // retry_task = 1: "up to 1 time" per task. A rank dies while no task runs; the next
    // task runs on a relaunched group (its answer names that death as try 0) and still
    // has its one retry for a death during it.
    let mut d = with_retries(2, 1);
    ready_group(&mut d);
    d.fail_group(death(1, SIGKILL));
    assert!(d.deferred.is_some() && d.group.is_none());
    ready_group(&mut d); // the relaunch
    let (rx, _) = sent_task(&mut d, &Signal::new());
    let before: Vec<u32> = d
        .task
        .as_ref()
        .unwrap()
        .cmd
        .reply
        .retries
        .iter()
        .map(|r| r.attempt)
        .collect();
    assert_eq!(before, vec![0], "the death before the task is try 0");
    d.fail_group(death(0, SIGKILL));
    let got = rx.try_recv();
    assert!(got.is_err(), "retried, not answered: {got:?}");
    d.drain_queue();
    let retried = d.pending.as_ref().and_then(|p| {
        p.waiters.iter().find_map(|w| match w {
            Waiter::Execute(c) => Some(
                c.reply
                    .retries
                    .iter()
                    .map(|r| (r.attempt, r.failure.rank))
                    .collect::<Vec<_>>(),
            ),
            Waiter::Start(_) => None,
        })
    });
    assert_eq!(
        retried,
        Some(vec![(0, 1), (1, 0)]),
        "try 1 of 1 for the death during the task"
    );
}
