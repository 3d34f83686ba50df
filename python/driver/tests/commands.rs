//! The driver answers every line, errors included, and exits when stdin closes. (This
//! test also makes `cargo test --workspace` build the binary the pytest suite drives.)

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

#[test]
fn every_line_gets_an_answer_and_eof_ends_the_driver() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rankexec-pydriver"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the driver");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut ask = |line: &str| -> serde_json::Value {
        writeln!(stdin, "{line}").expect("write");
        stdin.flush().expect("flush");
        let mut answer = String::new();
        out.read_line(&mut answer).expect("read");
        serde_json::from_str(&answer).expect("an answer is JSON")
    };
    let a = ask("not json");
    assert_eq!(a["ok"], false);
    assert!(a["error"].as_str().unwrap().starts_with("not JSON"), "{a}");
    let a = ask(r#"{"op": "pids"}"#);
    assert_eq!(a["error"], "no group: send `start` first");
    let a = ask(r#"{"op": "bogus"}"#);
    assert_eq!(a["error"], "unknown op `bogus`");
    let a = ask(r#"{"op": "start", "config": {"num_of_processes": "two"}}"#);
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .starts_with("invalid executor config"),
        "{a}"
    );
    let a = ask(r#"{"op": "rss"}"#);
    assert_eq!(a["ok"], true);
    assert!(a["rss_kib"].as_u64().unwrap() > 0);
    drop(stdin);
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}");
}
