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
    use std::io::{Read, Write};
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {reply:?}"))
}

#[test]
fn nginx_routes_creation_to_any_instance_and_sessions_to_their_owner() {
    let root = temp_dir("scaling-nginx");
    let token = "scaling-test-token-0123456789";
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .to_string()
    };
    let (addr_a, addr_b) = (free(), free());
    let start = |dir: &str, name: &str, addr: &str| {
        let data = root.join(dir);
        Start {
            data: &data,
            registrations: registrations(),
            extra: &["--instance", name, "--listen", addr],
            token: Some(token),
            env: &[],
            uid: None,
        }
        .run()
    };
    let a = start("a", "a", &addr_a);
    let mut b = start("b", "b", &addr_b);
    let router = nginx(&root, &[("a", &a), ("b", &b)]);
    let (mut on_a, mut on_b) = (None, None);
    let deadline = std::time::Instant::now() + WAIT;
    while on_a.is_none() || on_b.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "creation never reached both"
        );
        // Creating through the router lands on one of the two.
        let status = via(
            &router,
            token,
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "f", "configuration": {}}})),
        );
        assert_eq!(status, 201);
        let listed_b = b.call("GET", "/v1/sessions", None).expect(200, None).text();
        let listed_a = a.call("GET", "/v1/sessions", None).expect(200, None).text();
        if listed_b.contains("ses_1b") {
            on_b = listed_b
                .split("ses_1b")
                .nth(1)
                .map(|r| format!("ses_1b{}", &r[..18]));
        }
        if listed_a.contains("ses_1a") {
            on_a = listed_a
                .split("ses_1a")
                .nth(1)
                .map(|r| format!("ses_1a{}", &r[..18]));
        }
    }
    let (on_a, on_b) = (on_a.unwrap(), on_b.unwrap());
    assert_eq!(
        via(&router, token, "GET", &format!("/v1/sessions/{on_a}"), None),
        200
    );
    assert_eq!(
        via(&router, token, "GET", &format!("/v1/sessions/{on_b}"), None),
        200
    );
    assert_eq!(
        via(&router, token, "GET", "/instances/a/health/live", None),
        204
    );
    // SSE through the router flows live: nginx must not buffer the stream.
    let mut events = follow_via(&router, token, &on_a);
    let caught_up = events.until(|e| e.event == "session_created");
    assert_eq!(caught_up.last().map(|e| e.id), Some(1));
    assert_eq!(
        via(
            &router,
            token,
            "POST",
            &format!("/v1/sessions/{on_a}/messages"),
            Some(json!({"content": [{"type": "text", "text": "through nginx"}]})),
        ),
        200
    );
    let live = events.until(|e| e.event == "activation_finished");
    assert!(
        live.iter()
            .any(|e| e.data.to_string().contains("through nginx")),
        "{live:?}"
    );
    drop(events);
    // A killed instance: its sessions answer 502, the other's keep working, creation goes on.
    b.signal(nix::sys::signal::Signal::SIGKILL);
    b.wait_exit(WAIT);
    let status = via(&router, token, "GET", &format!("/v1/sessions/{on_b}"), None);
    assert!(status == 502 || status == 503, "{status}");
    assert_eq!(
        via(&router, token, "GET", &format!("/v1/sessions/{on_a}"), None),
        200
    );
    for _ in 0..4 {
        let status = via(
            &router,
            token,
            "POST",
            "/v1/sessions",
            Some(json!({"agentloop": {"name": "f", "configuration": {}}})),
        );
        assert_eq!(status, 201);
    }
    // It comes back on the same data directory and address, and its session with it.
    drop(b);
    let b = start("b", "b", &addr_b);
    assert_eq!(
        via(&router, token, "GET", &format!("/v1/sessions/{on_b}"), None),
        200
    );
    drop((router, a, b));
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
