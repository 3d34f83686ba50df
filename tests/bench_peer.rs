//! `rankexec bench --peer nvflare --quick` runs the NVFlare harness's experiments on real
//! rank groups and prints that harness's records: every experiment is there, every round
//! trip is correct, every fault ends in a typed error (not a hang), and the parent-kill
//! case leaves no orphan.

mod common;

use std::process::Command;

use common::*;

#[test]
fn peer_records_cover_every_experiment() {
    let out = Command::new(rankexec_bin())
        .args(["bench", "--peer", "nvflare", "--quick", "--worker"])
        .arg(worker_bin())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let records: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let of = |metric: &str| -> Vec<&serde_json::Value> {
        records.iter().filter(|r| r["metric"] == metric).collect()
    };
    assert!(records.iter().all(|r| r["impl"] == "rankexec"));
    assert_eq!(of("env").len(), 1);

    let startup = of("startup");
    assert_eq!(startup.len(), 3, "one run each for N = 1, 2, 4");
    assert!(startup.iter().all(|r| r["ready"] == true), "{startup:?}");

    let roundtrip = of("roundtrip");
    assert_eq!(roundtrip.len(), 4, "1 KB and 1 MB, echo and sum");
    assert!(roundtrip.iter().all(|r| r["ok"] == true), "{roundtrip:?}");

    let abort = of("abort");
    let end_runs: Vec<_> = abort
        .iter()
        .filter(|r| r["case"] == "END_RUN->finalize (ranks idle)")
        .collect();
    assert_eq!(end_runs.len(), 3);
    // Every rank was seen to exit (its pidfd became readable).
    for r in &end_runs {
        let per = r["per_process_gone_s"].as_object().unwrap();
        assert_eq!(per.len() as u64, r["n"].as_u64().unwrap());
        assert!(per.values().all(|v| v.is_f64()), "{r}");
    }
    let in_flight = abort
        .iter()
        .find(|r| r["case"] == "abort_signal triggered during an in-flight task")
        .unwrap();
    assert!(
        in_flight["execute_status"]
            .as_str()
            .unwrap()
            .starts_with("Aborted"),
        "{in_flight}"
    );

    let faults = of("fault");
    let case = |name: &str| {
        *faults
            .iter()
            .find(|r| r["case"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
    };
    for victim in [0, 1] {
        let r = case(&format!("a_kill_rank{victim}_idle_then_execute"));
        let status = r["execute_status"].as_str().unwrap();
        assert!(
            status.contains(&format!("rank {victim} failed")) && status.contains("SIGKILL"),
            "{r}"
        );
        assert_eq!(r["next_execute_status"], "ok", "relaunched: {r}");
        let r = case(&format!("b_rank{victim}_raises_in_execute"));
        assert_eq!(r["result_rc"], "Exception", "{r}");
        assert_eq!(r["next_normal_execute_status"], "ok", "{r}");
    }
    let c = case("c_parent_sigkill");
    assert_eq!(c["group_was_ready"], true, "{c}");
    assert_eq!(c["orphans_after_cap"], serde_json::json!([]), "{c}");
    let gone = c["per_process_gone_after_parent_kill_s"]
        .as_object()
        .unwrap();
    assert_eq!(gone.len(), 2, "{c}");
    let d = case("d_two_executors_at_once");
    assert_eq!(d["both_started"], true, "{d}");
    assert_eq!(d["all_roundtrips_ok"], true, "{d}");
    assert_eq!(d["listener_port_collision"], false, "{d}");
}
