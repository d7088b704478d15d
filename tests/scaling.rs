//! Several named Brain instances (issue 28): `brain serve --instance NAME` records its name in
//! the data directory, refuses another name later (exit 78), makes session ids carrying the
//! name at a fixed place, and answers a request for another instance's session 421 Misdirected
//! Request naming the owner instead of `unknown_session`. Real `brain serve` processes, real
//! fault-harness workers.

mod common;

use common::server::*;
use common::*;
use serde_json::json;
use std::process::Command;

fn registrations() -> serde_json::Value {
    json!({"f": {"command": FAULT_HARNESS}})
}

fn create(served: &Served) -> String {
    let reply = served
        .call(
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "f", "configuration": {}}})),
        )
        .expect(201, None);
    reply.json()["session_id"]
        .as_str()
        .expect("a session id")
        .to_owned()
}

#[test]
fn named_instances_tag_their_ids_and_answer_421_for_each_others_sessions() {
    let root = temp_dir("scaling-421");
    let (data_a, data_b) = (root.join("a"), root.join("b"));
    let a = serve(&data_a, registrations(), &["--instance", "a"]);
    let b = serve(&data_b, registrations(), &["--instance", "b1"]);
    let on_a = create(&a);
    let on_b = create(&b);
    assert!(on_a.starts_with("ses_1a"), "{on_a}");
    assert!(on_b.starts_with("ses_2b1"), "{on_b}");
    assert_eq!(on_a.len(), 24);

    a.call("GET", &format!("/v1/sessions/{on_a}"), None)
        .expect(200, None);
    let misdirected = b
        .call("GET", &format!("/v1/sessions/{on_a}"), None)
        .expect(421, Some("misdirected_request"));
    let text = misdirected.text();
    assert!(text.contains("instance \\\"a\\\""), "{text}");
    a.call("DELETE", &format!("/v1/sessions/{on_b}"), None)
        .expect(421, Some("misdirected_request"));
    // The session misdirected to `a` is untouched on its owner.
    b.call("GET", &format!("/v1/sessions/{on_b}"), None)
        .expect(200, None);
    drop((a, b));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_data_directory_keeps_its_instance_name_and_refuses_another_with_78() {
    let root = temp_dir("scaling-name");
    let data = root.join("data");
    let mut first = serve(&data, registrations(), &["--instance", "n1"]);
    first.terminate(WAIT);
    for (flags, recorded) in [
        (vec!["--instance", "n2"], "\"n1\""),
        (vec![], "\"n1\""),
        (vec!["--instance", "toolong"], "1 to 4"),
    ] {
        let output = run_bounded(
            Command::new(BRAIN)
                .arg("serve")
                .arg("--data-dir")
                .arg(&data)
                .args(["--listen", "127.0.0.1:0", "--agentloops"])
                .arg(registrations().to_string())
                .args(&flags)
                .env_remove("BRAIN_AGENTLOOPS"),
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(recorded), "{flags:?}: {stderr}");
        if recorded != "1 to 4" {
            assert_eq!(output.status.code(), Some(78), "{flags:?}: {stderr}");
        } else {
            assert_ne!(output.status.code(), Some(0), "{flags:?}: {stderr}");
        }
    }
    let again = serve(&data, registrations(), &["--instance", "n1"]);
    assert!(create(&again).starts_with("ses_2n1"));
    drop(again);
    std::fs::remove_dir_all(&root).unwrap();
}
