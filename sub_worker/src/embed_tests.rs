//! Tests of the embedding runtime's bridges, requests and caller's end.

use super::*;

#[test]
fn exit_codes_round_trip() {
    for c in [0u8, 1, 3, 5, 255] {
        assert_eq!(exit_code_of(std::process::ExitCode::from(c)), c);
    }
}

fn task_of<T>(r: Request<T>) -> Task<T> {
    match r {
        Request::Task(t) => t,
        _ => panic!("expected a task"),
    }
}

/// The caller's end of `inbox` before the rank is ready (no exec port yet).
fn tasks_over<T>(inbox: Inbox<T>, done: Receiver<u8>) -> Tasks<T> {
    Tasks {
        rx: inbox.rx,
        bell: inbox.bell,
        done,
        code: None,
        ports: bounded(1).1,
        port: None,
        pid: std::process::id(),
    }
}

#[test]
fn the_runtimes_end_wakes_the_waiting_caller() {
    let (_tx, inbox) = channel::<()>().unwrap();
    let (done_tx, done) = bounded(1);
    let bell = inbox.bell.clone();
    let mut tasks = tasks_over(inbox, done);
    assert!(matches!(tasks.next(Duration::from_millis(10)), Next::Idle));
    let runtime = std::thread::spawn(move || {
        done_tx.send(7).unwrap();
        bell.ring();
    });
    // Long enough that only the bell can end the wait within the test's run.
    assert!(matches!(
        tasks.next(Duration::from_secs(600)),
        Next::Stopped(7)
    ));
    runtime.join().unwrap();
    assert_eq!(tasks.exit_code(), Some(7));
}

#[test]
fn bridge_hands_the_task_over_and_returns_the_answer() {
    let (tx, rx) = channel::<u32>().unwrap();
    let bridge = Bridge::new(7u32, tx, false);
    let caller = std::thread::spawn(move || {
        let t = task_of(rx.rx.recv().unwrap());
        assert_eq!((t.payload, t.task.as_str()), (7, "train"));
        let mut ctx = t.ctx.clone();
        ctx.set_prop("seen", true, rankexec_protocol::PropFlags::PUBLIC)
            .unwrap();
        t.reply.send(Ok((t.input.with_meta("y", 2), ctx)));
    });
    let mut ctx = FlContext::new();
    let out = bridge
        .execute(
            "train",
            Shareable::new().with_meta("x", 1),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    caller.join().unwrap();
    assert_eq!(out.meta("y").and_then(|v| v.as_i64()), Some(2));
    assert!(ctx.get_prop("seen").is_some());
}

#[test]
fn a_task_dropped_without_reply_fails_the_task() {
    let (tx, rx) = channel::<()>().unwrap();
    let bridge = Bridge::new((), tx, false);
    let caller = std::thread::spawn(move || drop(rx.rx.recv().unwrap()));
    let err = bridge
        .execute("t", Shareable::new(), &mut FlContext::new(), &Signal::new())
        .unwrap_err();
    caller.join().unwrap();
    assert_eq!(err.message(), "the task was dropped without a reply");
}

#[test]
fn components_are_built_and_handle_events_on_the_callers_thread() {
    let (tx, rx) = channel::<u32>().unwrap();
    let (_running, done) = bounded(1);
    let mut tasks = tasks_over(rx, done);
    let caller = std::thread::current().id();
    let runtime = std::thread::spawn(move || {
        let cfg = ComponentConfig::new("c", "C", serde_json::json!({}));
        let c = build_on_caller(&tx, &cfg).unwrap();
        let mut ctx = FlContext::new();
        c.handler()
            .handle_event(&EventType::START_RUN, &mut ctx)
            .unwrap();
        ctx.get_prop("handled_on")
            .and_then(|v| v.as_str().map(str::to_owned))
    });
    let mut served = 0;
    while served < 2 {
        match tasks.next(Duration::from_secs(30)) {
            Next::Request(Request::Build(b)) => {
                assert_eq!(b.config.id, "c");
                b.reply
                    .send(Ok(Built {
                        payload: 9,
                        executor: true,
                        handles_events: true,
                    }))
                    .unwrap();
            }
            Next::Request(Request::Event(mut e)) => {
                assert_eq!((e.payload, e.event.as_str()), (9, "_start_run"));
                let on = format!("{:?}", std::thread::current().id());
                e.ctx
                    .set_prop("handled_on", on, rankexec_protocol::PropFlags::PUBLIC)
                    .unwrap();
                e.reply.send(Ok(e.ctx)).unwrap();
            }
            other => panic!("unexpected {other:?}"),
        }
        served += 1;
    }
    assert_eq!(runtime.join().unwrap(), Some(format!("{caller:?}")));
}

/// An engine that delivers events to one component, as a rank's engine does.
struct Local(Component);

impl Engine for Local {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        self.0
            .handler()
            .handle_event(event, ctx)
            .map_err(|source| FireEventError::Handler {
                component: "c".into(),
                event: event.to_string(),
                source,
            })
    }
    fn identity(&self) -> &str {
        "local"
    }
    fn job_id(&self) -> &str {
        "local"
    }
    fn workspace(&self) -> &std::path::Path {
        std::path::Path::new(".")
    }
}

#[test]
fn events_fired_by_the_caller_go_to_its_local_channel() {
    let (tx, rx) = channel::<u8>().unwrap();
    let engine = Local(Component::Handler(std::sync::Arc::new(Bridge::new(
        1u8, tx, true,
    ))));
    let (local_tx, local_rx) = unbounded::<Request<u8>>();
    let firing = std::thread::spawn(move || {
        fire_local(
            &engine,
            &EventType::new("mine"),
            &mut FlContext::new(),
            local_tx,
        )
    });
    match local_rx.recv_timeout(Duration::from_secs(30)).unwrap() {
        Request::Event(e) => e.reply.send(Ok(e.ctx)).unwrap(),
        other => panic!("unexpected {other:?}"),
    }
    firing.join().unwrap().unwrap();
    assert!(
        rx.rx.try_recv().is_err(),
        "nothing reached the caller's channel"
    );
}

#[test]
fn a_bridge_without_handler_answers_events_itself() {
    let (tx, rx) = channel::<()>().unwrap();
    let bridge = Bridge::new((), tx, false);
    bridge
        .handle_event(&EventType::START_RUN, &mut FlContext::new())
        .unwrap();
    assert!(rx.rx.try_recv().is_err());
}
