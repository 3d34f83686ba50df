//! `rankexec gpus` prints NVML's inventory, or why there is none (on a machine without
//! an NVIDIA driver: "no GPUs" with NVML's reason, and exit code 0).

mod common;

use std::process::Command;

use common::rankexec_bin;
use rankexec::executor::gpu::{Inventory, NvmlProbe};

#[test]
fn gpus_reports_what_nvml_says() {
    let out = Command::new(rankexec_bin())
        .args(["gpus", "--all"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let json = Command::new(rankexec_bin())
        .args(["gpus", "--all", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    match NvmlProbe.all() {
        Inventory::NoGpus { reason } => {
            assert!(text.starts_with(&format!("no GPUs: {reason}")), "{text}");
            assert!(text.contains("ranks will run on CPUs"), "{text}");
            assert_eq!(v["status"], "no_gpus");
            assert_eq!(v["reason"], reason.as_str());
        }
        Inventory::Gpus { gpus, .. } => {
            assert!(
                text.starts_with(&format!("{} GPU(s)", gpus.len())),
                "{text}"
            );
            assert_eq!(v["gpus"].as_array().unwrap().len(), gpus.len());
        }
    }
}
