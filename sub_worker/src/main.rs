//! `rankexec-worker`: the default rank program, with the built-in components.

fn main() -> std::process::ExitCode {
    rankexec_sub_worker::main(rankexec_sub_worker::builtins::registry())
}
