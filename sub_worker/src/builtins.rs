//! Built-in components of `rankexec-worker`, for tests, examples and benchmarks.
//!
//! | path | kind | what it does |
//! |---|---|---|
//! | `Echo` | executor | returns its input, plus `rank` |
//! | `Sum` | executor | sums the numbers in meta `values`, times `scale`; returns `sum`, `rank` |
//! | `Digest` | executor | returns a checksum, the size and (when mapped from a file) the inode of every blob (the fan-out benchmark) on chosen ranks |
//! | `Sleep` | executor | sleeps `secs` (meta or args), waking at once on abort unless `ignore_abort` |
//! | `Fail` | executor | fails (as an exception or out of memory) on chosen ranks (and `tasks`), at build or execute |
//! | `Panic` | executor | panics on chosen ranks, at build or execute |
//! | `Exit` | executor | exits with a code or kills itself with a signal on chosen ranks |
//! | `FireEvent` | executor | fires a custom event `count` times and returns what the parent added |
//! | `Env` | executor | returns the rank's environment variables (the secret is never there) |
//! | `Alloc` | executor | allocates (and touches) `bytes`, reporting a failure as out of memory |
//! | `EventLog` | handler | appends every event it sees to `rank-N/events.log`, can set props, can be slow |
//!
//! Every executor accepts `ranks: [..]` where it acts only on some ranks (default: all).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::Duration;

use rankexec_protocol::{
    ComponentError, EventType, Executor, FlComponent, FlContext, PropFlags, Registry, Shareable,
    Signal, Value, keys,
};
use serde::Deserialize;

use crate::rank::rank_info;

/// A registry with every built-in component.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.executor("Echo", |_: NoArgs| Ok(Echo))
        .executor("Sum", |a: SumArgs| Ok(Sum(a)))
        .executor("Digest", |a: DigestArgs| Ok(Digest(a)))
        .executor("Sleep", sleep)
        .executor("Fail", OnPurpose::<FailArgs>::build)
        .executor("Panic", OnPurpose::<PanicArgs>::build)
        .executor("Exit", OnPurpose::<ExitArgs>::build)
        .executor("FireEvent", |a: FireEventArgs| Ok(FireEvent(a)))
        .executor("Env", |_: NoArgs| Ok(Env))
        .executor("Alloc", |a: AllocArgs| Ok(Alloc(a)))
        .handler("EventLog", event_log);
    r
}

/// No arguments.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

fn my_rank(ctx: &FlContext) -> i64 {
    ctx.get_prop(keys::RANK_NUMBER)
        .and_then(Value::as_i64)
        .or_else(|| rank_info().map(|r| r.env.rank.into()))
        .unwrap_or(0)
}

fn acts_on(ranks: &Option<Vec<u32>>, rank: i64) -> bool {
    match ranks {
        None => true,
        Some(list) => list.iter().any(|r| i64::from(*r) == rank),
    }
}

fn build_rank() -> i64 {
    rank_info().map_or(0, |r| r.env.rank.into())
}

/// Returns its input, plus `rank`.
struct Echo;
impl FlComponent for Echo {}
impl Executor for Echo {
    fn execute(
        &self,
        _: &str,
        input: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = my_rank(ctx);
        let _ = ctx.set_prop("echoed_by", rank, PropFlags::PUBLIC);
        Ok(input.with_meta("rank", rank))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SumArgs {
    #[serde(default = "one")]
    scale: f64,
}

fn one() -> f64 {
    1.0
}

/// Sums meta `values` times `scale`.
struct Sum(SumArgs);
impl FlComponent for Sum {}
impl Executor for Sum {
    fn execute(
        &self,
        _: &str,
        input: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let values = match input.meta("values") {
            Some(Value::List(l)) => l.clone(),
            _ => {
                return Err(ComponentError::failed(
                    "meta `values` must be a list of numbers",
                ));
            }
        };
        let mut sum = 0.0;
        for v in values {
            sum += v
                .as_f64()
                .ok_or_else(|| ComponentError::failed(format!("`{v}` is not a number")))?;
        }
        Ok(Shareable::new()
            .with_meta("sum", sum * self.0.scale)
            .with_meta("rank", my_rank(ctx)))
    }
}

/// A fast checksum that touches every byte once: four independent FNV-style lanes over
/// 64-bit words (so the multiplications overlap), folded together at the end.
pub fn checksum(data: &[u8]) -> u64 {
    const P: u64 = 0x0000_0100_0000_01b3;
    let mut h: [u64; 4] = [
        0xcbf2_9ce4_8422_2325,
        0x8422_2325_cbf2_9ce4,
        0x9e37_79b9_7f4a_7c15,
        0x7f4a_7c15_9e37_79b9,
    ];
    let word = |c: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        u64::from_le_bytes(w)
    };
    let mut blocks = data.chunks_exact(32);
    for b in &mut blocks {
        for (i, lane) in h.iter_mut().enumerate() {
            *lane = (*lane ^ word(&b[i * 8..i * 8 + 8])).wrapping_mul(P);
        }
    }
    let mut acc = h
        .iter()
        .fold(data.len() as u64, |a, l| (a ^ l).wrapping_mul(P));
    for b in blocks.remainder() {
        acc = (acc ^ u64::from(*b)).wrapping_mul(P);
    }
    acc
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DigestArgs {
    #[serde(default)]
    ranks: Option<Vec<u32>>,
}

/// Returns `digest:NAME` and `bytes:NAME` for every blob, on chosen ranks (the others
/// only receive).
struct Digest(DigestArgs);
impl FlComponent for Digest {}
impl Executor for Digest {
    fn execute(
        &self,
        _: &str,
        input: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = my_rank(ctx);
        let mut out = Shareable::new().with_meta("rank", rank);
        if !acts_on(&self.0.ranks, rank) {
            return Ok(out);
        }
        for (name, blob) in input.blobs() {
            // Stored as a signed integer bit pattern: `Value` has no u64.
            out.set_meta(format!("digest:{name}"), checksum(blob) as i64);
            out.set_meta(format!("bytes:{name}"), blob.len());
            out.set_meta(format!("shared:{name}"), blob.is_shared());
            // Which file's pages this rank reads: the parent's memory file, if shared.
            if let Some(inode) = crate::os::mapped_inode(blob.as_ptr() as usize) {
                out.set_meta(format!("inode:{name}"), inode as i64);
                tracing::info!(rank, blob = %name, inode, "digest reads a mapped file");
            }
        }
        Ok(out)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SleepArgs {
    #[serde(default = "one")]
    secs: f64,
    #[serde(default)]
    ignore_abort: bool,
    #[serde(default)]
    ignore_sigterm: bool,
}

/// Sleeps, honouring abort unless told not to.
struct Sleep(SleepArgs);

fn sleep(a: SleepArgs) -> Result<Sleep, ComponentError> {
    if a.ignore_sigterm {
        crate::os::ignore_sigterm()
            .map_err(|e| ComponentError::failed("cannot ignore SIGTERM").with_source(e))?;
    }
    Ok(Sleep(a))
}

impl FlComponent for Sleep {}
impl Executor for Sleep {
    fn execute(
        &self,
        _: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let secs = input
            .meta("secs")
            .and_then(Value::as_f64)
            .unwrap_or(self.0.secs);
        let dur = Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX);
        tracing::info!(secs, "sleeping");
        if self.0.ignore_abort {
            std::thread::sleep(dur);
        } else if abort.wait_timeout(dur) {
            return Err(ComponentError::aborted());
        }
        Ok(Shareable::new()
            .with_meta("slept", secs)
            .with_meta("rank", my_rank(ctx)))
    }
}

#[derive(Deserialize, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "snake_case")]
enum When {
    Build,
    #[default]
    Execute,
}

#[derive(Deserialize, Clone, Copy, Default)]
#[serde(rename_all = "snake_case")]
enum FailClass {
    #[default]
    Exception,
    OutOfMemory,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailArgs {
    #[serde(default = "default_fail_message")]
    message: String,
    #[serde(default)]
    ranks: Option<Vec<u32>>,
    #[serde(default)]
    when: When,
    #[serde(default)]
    class: FailClass,
    /// Only these task names fail (default: every task).
    #[serde(default)]
    tasks: Option<Vec<String>>,
}

fn default_fail_message() -> String {
    "failed on purpose".to_owned()
}

/// A way to misbehave on purpose (fail, panic, exit) on chosen ranks, at build or at execute.
///
/// [`OnPurpose`] turns one into an executor that misbehaves where the arguments say and echoes
/// the input (with its rank in the meta) everywhere else.
trait Misbehaviour: Sized + Send + Sync + 'static {
    /// The ranks that misbehave (`None` = all).
    fn ranks(&self) -> &Option<Vec<u32>>;
    /// When to misbehave.
    fn when(&self) -> When;
    /// Misbehaves; returns the error to report when the misbehaviour returns at all.
    fn act(&self, rank: i64) -> ComponentError;
    /// Whether a task of this name misbehaves (default: every task).
    fn on_task(&self, _task: &str) -> bool {
        true
    }
}

/// The executor built from a [`Misbehaviour`].
struct OnPurpose<M>(M);

impl<M: Misbehaviour> OnPurpose<M> {
    fn build(args: M) -> Result<Self, ComponentError> {
        let rank = build_rank();
        if args.when() == When::Build && acts_on(args.ranks(), rank) {
            return Err(args.act(rank));
        }
        Ok(Self(args))
    }
}

impl<M: Misbehaviour> FlComponent for OnPurpose<M> {}
impl<M: Misbehaviour> Executor for OnPurpose<M> {
    fn execute(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = my_rank(ctx);
        if self.0.when() == When::Execute && acts_on(self.0.ranks(), rank) && self.0.on_task(task) {
            return Err(self.0.act(rank));
        }
        Ok(input.with_meta("rank", rank))
    }
}

/// `Fail`: returns a component error (an exception, or out-of-memory).
impl Misbehaviour for FailArgs {
    fn ranks(&self) -> &Option<Vec<u32>> {
        &self.ranks
    }
    fn when(&self) -> When {
        self.when
    }
    fn act(&self, rank: i64) -> ComponentError {
        let msg = format!("{} (rank {rank})", self.message);
        match self.class {
            FailClass::Exception => ComponentError::failed(msg),
            FailClass::OutOfMemory => ComponentError::out_of_memory(msg),
        }
    }
    fn on_task(&self, task: &str) -> bool {
        self.tasks
            .as_ref()
            .is_none_or(|t| t.iter().any(|name| name == task))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PanicArgs {
    #[serde(default)]
    ranks: Option<Vec<u32>>,
    #[serde(default)]
    when: When,
}

/// `Panic`: panics (the rank reports the panic as a failure and stays up).
impl Misbehaviour for PanicArgs {
    fn ranks(&self) -> &Option<Vec<u32>> {
        &self.ranks
    }
    fn when(&self) -> When {
        self.when
    }
    fn act(&self, rank: i64) -> ComponentError {
        match self.when {
            When::Build => panic!("panic on purpose while building (rank {rank})"),
            When::Execute => panic!("panic on purpose (rank {rank})"),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExitArgs {
    #[serde(default = "one_i32")]
    code: i32,
    #[serde(default)]
    signal: Option<String>,
    #[serde(default)]
    ranks: Option<Vec<u32>>,
    #[serde(default)]
    when: When,
    #[serde(default)]
    error_file_message: Option<String>,
}

fn one_i32() -> i32 {
    1
}

/// `Exit`: ends the process with a code or a signal, optionally writing a torchrun-style
/// error file first.
impl Misbehaviour for ExitArgs {
    fn ranks(&self) -> &Option<Vec<u32>> {
        &self.ranks
    }
    fn when(&self) -> When {
        self.when
    }
    fn act(&self, rank: i64) -> ComponentError {
        if let Some(msg) = &self.error_file_message {
            crate::errorfile::write(
                "RuntimeError",
                msg,
                &format!("rank {rank} exited on purpose"),
            );
        }
        let _ = std::io::stderr().flush();
        if let Some(sig) = &self.signal {
            if let Err(e) = crate::os::kill_self(sig) {
                return ComponentError::failed("cannot signal myself").with_source(e);
            }
            // The signal is delivered before kill returns for most signals; wait for it.
            std::thread::sleep(Duration::from_secs(5));
            return ComponentError::failed(format!("{sig} did not end the process"));
        }
        std::process::exit(self.code);
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FireEventArgs {
    #[serde(default = "default_event")]
    event: String,
    #[serde(default = "one_u64")]
    count: u64,
    #[serde(default)]
    ranks: Option<Vec<u32>>,
}

fn default_event() -> String {
    "custom_event".to_owned()
}

fn one_u64() -> u64 {
    1
}

/// Fires a custom event `count` times (meta `count` overrides) with prop `fired_from`,
/// and returns every public prop the parent's handlers added.
struct FireEvent(FireEventArgs);
impl FlComponent for FireEvent {}
impl Executor for FireEvent {
    fn execute(
        &self,
        _: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = my_rank(ctx);
        let mut out = Shareable::new().with_meta("rank", rank);
        if !acts_on(&self.0.ranks, rank) {
            return Ok(out);
        }
        let count = input
            .meta("count")
            .and_then(Value::as_i64)
            .map_or(self.0.count, |c| c.max(0) as u64);
        let engine = ctx
            .engine()
            .cloned()
            .ok_or_else(|| ComponentError::failed("no engine in the task context"))?;
        let event = EventType::new(self.0.event.clone());
        let _ = ctx.set_prop("fired_from", rank, PropFlags::PUBLIC);
        for _ in 0..count {
            if abort.is_triggered() {
                return Err(ComponentError::aborted());
            }
            engine
                .fire_event(&event, ctx)
                .map_err(|e| ComponentError::failed("event relay failed").with_source(e))?;
        }
        for (k, p) in ctx.props() {
            if !p.private && k != "fired_from" {
                out.set_meta(format!("ctx:{k}"), p.value.clone());
            }
        }
        Ok(out.with_meta("fired", count))
    }
}

/// Returns the environment as meta `env:NAME`.
struct Env;
impl FlComponent for Env {}
impl Executor for Env {
    fn execute(
        &self,
        _: &str,
        _: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let mut out = Shareable::new().with_meta("rank", my_rank(ctx));
        for (k, v) in std::env::vars() {
            out.set_meta(format!("env:{k}"), v);
        }
        Ok(out)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllocArgs {
    bytes: u64,
    #[serde(default)]
    touch: bool,
    #[serde(default)]
    ranks: Option<Vec<u32>>,
}

/// Allocates `bytes` with a fallible reservation; a failure is out of memory.
struct Alloc(AllocArgs);
impl FlComponent for Alloc {}
impl Executor for Alloc {
    fn execute(
        &self,
        _: &str,
        _: Shareable,
        ctx: &mut FlContext,
        _: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let rank = my_rank(ctx);
        if !acts_on(&self.0.ranks, rank) {
            return Ok(Shareable::new().with_meta("rank", rank));
        }
        let n = usize::try_from(self.0.bytes).map_err(|_| {
            ComponentError::out_of_memory("allocation larger than the address space")
        })?;
        let mut v: Vec<u8> = Vec::new();
        v.try_reserve_exact(n).map_err(|e| {
            ComponentError::out_of_memory(format!("cannot allocate {n} bytes")).with_source(e)
        })?;
        if self.0.touch {
            v.resize(n, 1);
        }
        Ok(Shareable::new()
            .with_meta("rank", rank)
            .with_meta("allocated", self.0.bytes))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventLogArgs {
    #[serde(default)]
    set: BTreeMap<String, serde_json::Value>,
    /// Sleep this long in every handler (to play a rank that acknowledges too late).
    #[serde(default)]
    delay_ms: u64,
    /// Only these events are slow (default: every event).
    #[serde(default)]
    delay_events: Vec<String>,
}

/// Appends each event name to `rank-N/events.log` and sets `set` as public props.
struct EventLog {
    set: BTreeMap<String, Value>,
    file: Option<std::sync::Mutex<std::fs::File>>,
    delay: Duration,
    delay_events: Vec<String>,
}

fn event_log(a: EventLogArgs) -> Result<EventLog, ComponentError> {
    let file = match rank_info().and_then(|r| r.dir.clone()) {
        Some(dir) => {
            std::fs::create_dir_all(&dir).map_err(|e| {
                ComponentError::failed("cannot create the rank directory").with_source(e)
            })?;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("events.log"))
                .map_err(|e| ComponentError::failed("cannot open events.log").with_source(e))?;
            Some(std::sync::Mutex::new(f))
        }
        None => None,
    };
    Ok(EventLog {
        set: a
            .set
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_json(v)))
            .collect(),
        file,
        delay: Duration::from_millis(a.delay_ms),
        delay_events: a.delay_events,
    })
}

impl FlComponent for EventLog {
    fn handle_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), ComponentError> {
        if self.delay_events.is_empty() || self.delay_events.iter().any(|e| e == event.as_str()) {
            std::thread::sleep(self.delay);
        }
        if let Some(f) = &self.file {
            let mut f = f.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            writeln!(f, "{event}")
                .and_then(|()| f.sync_data())
                .map_err(|e| ComponentError::failed("cannot write events.log").with_source(e))?;
        }
        for (k, v) in &self.set {
            ctx.set_prop(k.clone(), v.clone(), PropFlags::PUBLIC)
                .map_err(|e| ComponentError::failed("cannot set prop").with_source(e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_differs_on_any_byte() {
        let a = vec![0u8; 1001];
        let mut b = a.clone();
        b[1000] = 1;
        assert_ne!(checksum(&a), checksum(&b));
        b[1000] = 0;
        b[3] = 1;
        assert_ne!(checksum(&a), checksum(&b));
    }

    #[test]
    fn registry_validates_args_without_building() {
        let r = registry();
        let bad = rankexec_protocol::ComponentConfig::new(
            "s",
            "Sleep",
            serde_json::json!({"secs": "long"}),
        );
        assert!(r.check(&bad).is_err());
        let unknown_key =
            rankexec_protocol::ComponentConfig::new("e", "Echo", serde_json::json!({"x": 1}));
        assert!(r.check(&unknown_key).is_err());
        let ok =
            rankexec_protocol::ComponentConfig::new("s", "Sleep", serde_json::json!({"secs": 0.5}));
        assert!(r.check(&ok).is_ok());
    }
}
