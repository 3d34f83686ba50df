//! The command line every worker binary built on this crate understands.
//!
//! ```text
//! WORKER                              run as a rank (the executor sets the environment)
//! WORKER --list-components            print the registered component paths as JSON
//! WORKER --check-components JSON|-    validate component configs (JSON array) without
//!                                     building them; exit 1 and print why if any is bad
//! WORKER --version | --help
//! ```
//!
//! The host uses `--list-components` and `--check-components` to validate a job before
//! any rank starts, whatever worker binary the job names.

use std::io::Read as _;
use std::process::ExitCode;

use rankexec_protocol::{ComponentConfig, Registry};

use crate::rank::{EXIT_USAGE, run};

const USAGE: &str =
    "usage: WORKER [--list-components | --check-components JSON|- | --version | --help]
Without arguments, runs as a rankexec rank; the executor provides the environment.";

/// Runs a worker binary: parses the command line, then serves as a rank. Call it from
/// `main`; it returns the exit code.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     let mut registry = rankexec_sub_worker::builtins::registry();
///     // registry.executor("MyTrainer", |args: MyArgs| MyTrainer::new(args));
///     rankexec_sub_worker::main(registry)
/// }
/// ```
pub fn main(registry: Registry) -> ExitCode {
    main_with_args(registry, std::env::args().skip(1).collect())
}

/// [`main`] with explicit arguments (for multi-call binaries).
pub fn main_with_args(registry: Registry, args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        None => run(registry),
        Some("--list-components") => {
            let list: Vec<serde_json::Value> = registry
                .paths()
                .map(|(path, kind)| serde_json::json!({"path": path, "kind": kind}))
                .collect();
            println!("{}", serde_json::Value::Array(list));
            ExitCode::SUCCESS
        }
        Some("--check-components") => check(&registry, args.get(1).map(String::as_str)),
        Some("--version") => {
            println!("{}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("--help" | "-h") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("unknown argument `{other}`\n{USAGE}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn check(registry: &Registry, arg: Option<&str>) -> ExitCode {
    let text = match arg {
        Some("-") | None => {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                eprintln!("cannot read stdin: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
            s
        }
        Some(json) => json.to_owned(),
    };
    let configs: Vec<ComponentConfig> = match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("--check-components needs a JSON array of {{id, path, args}}: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let errors: Vec<serde_json::Value> = configs
        .iter()
        .filter_map(|c| registry.check(c).err().map(|e| (c, e)))
        .map(|(c, e)| {
            let text = rankexec_protocol::error_chain(&e);
            serde_json::json!({"id": c.id, "path": c.path, "error": text})
        })
        .collect();
    let ok = errors.is_empty();
    println!("{}", serde_json::json!({"ok": ok, "errors": errors}));
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
