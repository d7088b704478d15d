//! Client commands against a running `brain serve`: `brain ready` and `brain sessions …`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// One request with `Connection: close`; returns the status and the body.
fn request(
    listen: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Result<(u16, String), String> {
    let address = listen
        .to_socket_addrs()
        .map_err(|e| format!("{listen}: {e}"))?
        .next()
        .ok_or_else(|| format!("{listen}: no address"))?;
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
        .map_err(|e| format!("connecting to {listen}: {e}"))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(3600)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {listen}\r\nConnection: close\r\n");
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = body.unwrap_or("");
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .map_err(|e| format!("sending to {listen}: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .map_err(|e| format!("reading from {listen}: {e}"))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{listen}: not an HTTP response"))?;
    Ok((status, body.to_owned()))
}

/// `brain ready`: exit 0 when the server answers /health/ready with 204, else 1.
pub fn ready(listen: &str) -> ExitCode {
    match request(listen, "GET", "/health/ready", None, None) {
        Ok((204, _)) => ExitCode::SUCCESS,
        Ok((status, body)) => {
            eprintln!("brain: not ready ({status}): {body}");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("brain: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The API token: `BRAIN_API_TOKEN`, else `<data-dir>/operator.token`.
fn token(data_dir: &Path) -> Result<String, String> {
    if let Some(token) = brain::hardening::var("BRAIN_API_TOKEN").and_then(|t| t.into_string().ok())
        && !token.trim().is_empty()
    {
        return Ok(token.trim().to_owned());
    }
    let path = data_dir.join("operator.token");
    std::fs::read_to_string(&path)
        .map(|t| t.trim().to_owned())
        .map_err(|e| {
            format!(
                "reading the API token {}: {e} (or set BRAIN_API_TOKEN)",
                path.display()
            )
        })
}

/// Why a client command failed: a usage error (exit 2) or anything else (exit 1).
pub enum Failure {
    Usage(String),
    Other(String),
}

/// `brain sessions list|show|events|cancel|close|delete`.
pub fn sessions(listen: &str, data_dir: &Path, args: &[String]) -> Result<ExitCode, Failure> {
    let (method, path) = route(args).map_err(Failure::Usage)?;
    let token = token(data_dir).map_err(Failure::Other)?;
    let (status, body) =
        request(listen, method, &path, Some(&token), None).map_err(Failure::Other)?;
    if !body.is_empty() {
        match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(json) => println!(
                "{}",
                serde_json::to_string_pretty(&json).unwrap_or(body.clone())
            ),
            Err(_) => println!("{body}"),
        }
    }
    Ok(if (200..300).contains(&status) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The method and path of a `sessions` subcommand.
fn route(args: &[String]) -> Result<(&'static str, String), String> {
    let id = |n: usize| -> Result<String, String> {
        let id = args
            .get(n)
            .ok_or_else(|| format!("sessions {}: a SESSION_ID is needed", args[0]))?;
        brain::session::SessionId::parse(id).map(|id| id.to_string())
    };
    let (method, path) = match args.first().map(String::as_str) {
        Some("list") => ("GET", "/v1/sessions".to_owned()),
        Some("show") => ("GET", format!("/v1/sessions/{}", id(1)?)),
        Some("events") => {
            let after = args.get(2).map_or("0", String::as_str);
            let after: u64 = after
                .parse()
                .map_err(|_| format!("sessions events: AFTER {after:?} is not a number"))?;
            (
                "GET",
                format!("/v1/sessions/{}/events?after={after}&limit=1000", id(1)?),
            )
        }
        Some("cancel") => ("POST", format!("/v1/sessions/{}/cancel", id(1)?)),
        Some("close") => ("POST", format!("/v1/sessions/{}/close", id(1)?)),
        Some("delete") => ("DELETE", format!("/v1/sessions/{}", id(1)?)),
        Some(other) => return Err(format!("sessions: unknown subcommand {other:?}")),
        None => return Err("sessions: list, show, events, cancel, close or delete".to_owned()),
    };
    Ok((method, path))
}

/// `brain sessions list --instance NAME=HOST:PORT …`: every instance's listing, merged into one
/// `{"sessions": [...], "instances": {...}}`. Each session carries the `instance` that answered
/// for it; `instances` says, per name, how many sessions it listed or why it could not be
/// listed. The instances share one API token (`BRAIN_API_TOKEN`). Exit 1 when any instance did
/// not answer its listing, after printing what the others did.
pub fn list_merged(
    instances: &[crate::router::Instance],
    data_dir: &Path,
) -> Result<ExitCode, Failure> {
    let token = token(data_dir).map_err(Failure::Other)?;
    let mut sessions = Vec::new();
    let mut answered = serde_json::Map::new();
    let mut complete = true;
    for instance in instances {
        let name = instance.name.as_str();
        let listing = request(&instance.addr, "GET", "/v1/sessions", Some(&token), None).and_then(
            |(status, body)| {
                let json: serde_json::Value = serde_json::from_str(&body)
                    .map_err(|e| format!("{}: the listing is not JSON: {e}", instance.addr))?;
                match (status, json.get("sessions").and_then(|s| s.as_array())) {
                    (200, Some(listed)) => Ok(listed.clone()),
                    _ => Err(format!("{} answered {status}: {json}", instance.addr)),
                }
            },
        );
        match listing {
            Ok(listed) => {
                answered.insert(
                    name.to_owned(),
                    serde_json::json!({"sessions": listed.len()}),
                );
                sessions.extend(listed.into_iter().map(|mut session| {
                    if let Some(fields) = session.as_object_mut() {
                        fields.insert("instance".to_owned(), name.into());
                    }
                    session
                }));
            }
            Err(error) => {
                complete = false;
                answered.insert(name.to_owned(), serde_json::json!({"error": error}));
            }
        }
    }
    let merged = serde_json::json!({"sessions": sessions, "instances": answered});
    println!(
        "{}",
        serde_json::to_string_pretty(&merged).unwrap_or_else(|_| merged.to_string())
    );
    Ok(if complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
