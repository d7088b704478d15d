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

/// nginx from Debian (scripts/test installs it when missing), running in the foreground on
/// 127.0.0.1 with the configuration `brain router-config` generates.
struct Nginx {
    child: std::process::Child,
    port: u16,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its worker too (a SIGKILL would leave the worker).
        signal(self.child.id(), nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

fn nginx(root: &std::path::Path, instances: &[(&str, &Served)]) -> Nginx {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut command = Command::new(BRAIN);
    command.args(["router-config", "--listen", &format!("127.0.0.1:{port}")]);
    for (name, served) in instances {
        command.args(["--instance", &format!("{name}={}", served.addr)]);
    }
    let generated = run_bounded(&mut command);
    assert!(generated.status.success(), "{generated:?}");
    std::fs::write(root.join("brain.conf"), &generated.stdout).unwrap();
    let r = root.display();
    let conf = format!(
        "daemon off;\nworker_processes 1;\npid {r}/nginx.pid;\nerror_log {r}/error.log;\n\
         events {{}}\nhttp {{\n access_log off;\n client_body_temp_path {r}/body;\n \
         proxy_temp_path {r}/proxy;\n fastcgi_temp_path {r}/fcgi;\n uwsgi_temp_path {r}/uwsgi;\n \
         scgi_temp_path {r}/scgi;\n include {r}/brain.conf;\n}}\n"
    );
    std::fs::write(root.join("nginx.conf"), conf).unwrap();
    let binary = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("nginx is not installed: scripts/test installs it (apt-get install nginx-light)");
    let child = Command::new(binary)
        .arg("-c")
        .arg(root.join("nginx.conf"))
        .arg("-p")
        .arg(root)
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("start nginx");
    let nginx = Nginx { child, port };
    let deadline = std::time::Instant::now() + WAIT;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "nginx never listened");
        std::thread::yield_now();
    }
    nginx
}

/// Follows a session's events through the router. HTTP/1.0, so nginx passes the stream through
/// as it comes instead of re-chunking it.
fn follow_via(nginx: &Nginx, token: &str, id: &str) -> common::http::Sse {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        stream,
        "GET /v1/sessions/{id}/events HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Accept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    common::http::Sse::open(stream)
}

fn via(
    nginx: &Nginx,
    token: &str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> u16 {
    via_with(nginx, token, method, path, body, "").0
}

/// One request through the router with extra header lines; the status and the body.
fn via_with(
    nginx: &Nginx,
    token: &str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
    headers: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {token}\r\n{headers}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {reply:?}"));
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_owned())
}

#[test]
fn three_instances_behind_nginx_share_sessions_and_one_killed_affects_only_its_own() {
    let root = temp_dir("scaling-nginx");
    let token = "scaling-test-token-0123456789";
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .to_string()
    };
    let names = ["a", "b", "c"];
    let addrs: Vec<String> = names.iter().map(|_| free()).collect();
    let start = |name: &str, addr: &str| {
        let data = root.join(name);
        Start {
            data: &data,
            registrations: registrations(),
            extra: &["--instance", name, "--listen", addr],
            token: Some(token),
            env: &[],
            uid: None,
            umask: None,
        }
        .run()
    };
    let mut served: Vec<Served> = names.iter().zip(&addrs).map(|(n, a)| start(n, a)).collect();
    let router = nginx(
        &root,
        &[("a", &served[0]), ("b", &served[1]), ("c", &served[2])],
    );
    let create_via = |configuration: serde_json::Value| {
        let (status, body) = via_with(
            &router,
            token,
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "f", "configuration": configuration}})),
            "",
        );
        assert_eq!(status, 201, "{body}");
        let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        reply["session_id"].as_str().expect("an id").to_owned()
    };
    let owner = |id: &str| {
        names
            .iter()
            .position(|n| id.starts_with(&format!("ses_1{n}")))
    };

    // 300 sessions created through the router land on all three, each at least 20 %.
    let mut ids: Vec<String> = (0..300).map(|_| create_via(json!({}))).collect();
    let mut per = [0usize; 3];
    for id in &ids {
        per[owner(id).unwrap_or_else(|| panic!("{id} names no instance"))] += 1;
    }
    assert!(
        per.iter().all(|&n| n >= 60),
        "sessions per instance: {per:?}"
    );
    let first_of = |i: usize| ids.iter().find(|id| owner(id) == Some(i)).unwrap().clone();
    let on: Vec<String> = (0..3).map(first_of).collect();

    // Messages and events through the router reach each owner.
    let message = |id: &str, text: &str| {
        via_with(
            &router,
            token,
            "POST",
            &format!("/v1/sessions/{id}/messages"),
            Some(json!({"content": [{"type": "text", "text": text}]})),
            "",
        )
    };
    for id in &on {
        let (status, body) = message(id, &format!("hello {id}"));
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(&format!("hello {id}")), "{body}");
        let (status, body) = via_with(
            &router,
            token,
            "GET",
            &format!("/v1/sessions/{id}/events"),
            None,
            "",
        );
        assert_eq!(status, 200);
        assert!(body.contains("activation_finished"), "{body}");
    }
    // SSE through the router flows live: nothing between holds the stream back.
    let mut events = follow_via(&router, token, &on[0]);
    events.until(|e| e.event == "activation_finished");
    assert_eq!(message(&on[0], "through nginx").0, 200);
    let live = events.until(|e| e.event == "activation_finished");
    assert!(
        live.iter()
            .any(|e| e.data.to_string().contains("through nginx")),
        "{live:?}"
    );
    drop(events);
    // A cancel through the router reaches the owner and ends a hanging activation.
    let hanging = create_via(json!({"fault": "hang"}));
    ids.push(hanging.clone());
    let mut events = follow_via(&router, token, &hanging);
    events.until(|e| e.event == "session_created");
    let (status, body) = via_with(
        &router,
        token,
        "POST",
        &format!("/v1/sessions/{hanging}/messages"),
        Some(json!({"content": [{"type": "text", "text": "hang"}]})),
        "Prefer: respond-async\r\n",
    );
    assert_eq!(status, 202, "{body}");
    events.until(|e| e.event == "activation_started");
    let (status, body) = via_with(
        &router,
        token,
        "POST",
        &format!("/v1/sessions/{hanging}/cancel"),
        None,
        "",
    );
    assert_eq!(status, 200, "{body}");
    let finished = events.until(|e| e.event == "activation_finished");
    let outcome = finished
        .last()
        .map(|e| e.data.to_string())
        .unwrap_or_default();
    assert!(outcome.contains("cancelled"), "{outcome}");
    drop(events);

    // SIGKILL of c: only c's sessions fail through the router; a and b keep serving creates and
    // messages.
    let mut c = served.pop().expect("c");
    c.signal(nix::sys::signal::Signal::SIGKILL);
    c.wait_exit(WAIT);
    let status = via(
        &router,
        token,
        "GET",
        &format!("/v1/sessions/{}", on[2]),
        None,
    );
    assert!(status == 502 || status == 503, "{status}");
    for id in &on[..2] {
        assert_eq!(message(id, "still here").0, 200);
    }
    for _ in 0..6 {
        let id = create_via(json!({}));
        assert_ne!(owner(&id), Some(2), "{id} was created on the dead instance");
        ids.push(id);
    }
    // c comes back on the same data directory and address with every session of it.
    drop(c);
    served.push(start("c", &addrs[2]));
    for id in ids.iter().filter(|id| owner(id) == Some(2)) {
        assert_eq!(
            via(&router, token, "GET", &format!("/v1/sessions/{id}"), None),
            200,
            "{id}"
        );
    }
    let (status, body) = message(&on[2], "after the restart");
    assert_eq!(status, 200, "{body}");

    // The merged listing shows every session of the three.
    let (code, merged) = list_merged(
        token,
        &[("a", &served[0]), ("b", &served[1]), ("c", &served[2])],
    );
    assert_eq!(code, 0, "{merged}");
    let mut listed: Vec<String> = merged["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["session_id"].as_str().expect("an id").to_owned())
        .collect();
    listed.sort();
    ids.sort();
    assert_eq!(listed, ids);
    drop((router, served));
    std::fs::remove_dir_all(&root).unwrap();
}

/// `brain sessions list --instance …` with the shared token, its exit code and its JSON.
fn list_merged(token: &str, instances: &[(&str, &Served)]) -> (i32, serde_json::Value) {
    let mut command = Command::new(BRAIN);
    command.args(["sessions", "list"]);
    for (name, served) in instances {
        command.args(["--instance", &format!("{name}={}", served.addr)]);
    }
    let output = run_bounded(command.env("BRAIN_API_TOKEN", token));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json = serde_json::from_str(&stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}): {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().expect("an exit code"), json)
}

#[test]
fn the_cli_merges_every_instances_listing_and_names_one_that_does_not_answer() {
    let root = temp_dir("scaling-list");
    let token = "scaling-list-token-0123456789";
    let start = |name: &str| {
        let data = root.join(name);
        Start {
            data: &data,
            registrations: registrations(),
            extra: &["--instance", name],
            token: Some(token),
            env: &[],
            uid: None,
            umask: None,
        }
        .run()
    };
    let (a, mut b) = (start("a"), start("b"));
    let on_a = [create(&a), create(&a)];
    let on_b = create(&b);

    let (code, merged) = list_merged(token, &[("a", &a), ("b", &b)]);
    assert_eq!(code, 0, "{merged}");
    let listed: Vec<(String, String)> = merged["sessions"]
        .as_array()
        .expect("a sessions array")
        .iter()
        .map(|s| {
            let field = |key: &str| s[key].as_str().expect(key).to_owned();
            (field("session_id"), field("instance"))
        })
        .collect();
    let mut expected = vec![
        (on_a[0].clone(), "a".to_owned()),
        (on_a[1].clone(), "a".to_owned()),
        (on_b.clone(), "b".to_owned()),
    ];
    let mut sorted = listed.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(sorted, expected, "{merged}");
    assert_eq!(
        merged["instances"],
        json!({"a": {"sessions": 2}, "b": {"sessions": 1}})
    );

    // An instance that is down is named, the others are still listed, and the exit says so.
    b.signal(nix::sys::signal::Signal::SIGKILL);
    b.wait_exit(WAIT);
    let (code, merged) = list_merged(token, &[("a", &a), ("b", &b)]);
    assert_eq!(code, 1, "{merged}");
    assert_eq!(
        merged["sessions"].as_array().map(Vec::len),
        Some(2),
        "{merged}"
    );
    assert_eq!(merged["instances"]["a"], json!({"sessions": 2}));
    let error = merged["instances"]["b"]["error"]
        .as_str()
        .expect("b's error");
    assert!(error.contains(&b.addr.to_string()), "{error}");
    drop((a, b));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn the_shipped_nginx_configuration_is_the_generators_output() {
    let output = run_bounded(Command::new(BRAIN).args([
        "router-config",
        "--listen",
        "127.0.0.1:8080",
        "--instance",
        "a=127.0.0.1:8081",
        "--instance",
        "b=127.0.0.1:8082",
        "--instance",
        "c=127.0.0.1:8083",
    ]));
    assert!(output.status.success(), "{output:?}");
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/nginx/brain.conf"
    ))
    .expect("examples/nginx/brain.conf");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        shipped,
        "regenerate examples/nginx/brain.conf with the command above"
    );
}
