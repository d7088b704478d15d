//! docs/openapi.yaml against the server: the document names exactly the routes and methods the
//! router answers, a real `brain serve` answers every operation the document names (and 405 with
//! the document's methods for every other), authentication is required exactly where the document
//! says, and `GET /v1/openapi.yaml` serves the document byte for byte.

mod common;

use common::adapter::Scratch;
use common::server::*;
use common::*;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};

const METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

fn document() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml"))
        .expect("docs/openapi.yaml");
    serde_norway::from_str(&text).expect("docs/openapi.yaml is YAML")
}

/// Path template → the methods the document gives it, upper case.
fn documented(doc: &Value) -> BTreeMap<String, BTreeSet<String>> {
    let paths = doc["paths"].as_object().expect("paths");
    paths
        .iter()
        .map(|(path, item)| {
            let methods = item
                .as_object()
                .expect("a path item")
                .keys()
                .filter(|key| METHODS.contains(&key.to_uppercase().as_str()))
                .map(|key| key.to_uppercase())
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

fn routed() -> BTreeMap<String, BTreeSet<String>> {
    brain::http::routes()
        .map(|(template, allow)| {
            let methods = allow.split(", ").map(str::to_owned).collect();
            (template.to_owned(), methods)
        })
        .collect()
}

#[test]
fn the_document_names_exactly_the_routes_and_methods_the_router_answers() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    let documented = documented(&doc);
    let routed = routed();
    let missing: Vec<_> = routed
        .iter()
        .filter(|(path, methods)| documented.get(*path) != Some(methods))
        .collect();
    assert!(
        missing.is_empty(),
        "routes the server answers that docs/openapi.yaml lacks or gives other methods: {missing:?}"
    );
    let extra: Vec<_> = documented
        .keys()
        .filter(|path| !routed.contains_key(*path))
        .collect();
    assert!(
        extra.is_empty(),
        "paths in docs/openapi.yaml the server does not answer: {extra:?}"
    );
    // Every operation has an id (generators name methods after it), and every `$ref` resolves.
    let mut ids = BTreeSet::new();
    for (path, methods) in &documented {
        for method in methods {
            let operation = &doc["paths"][path][method.to_lowercase()];
            let id = operation["operationId"].as_str().unwrap_or_else(|| {
                panic!("{method} {path} has no operationId");
            });
            assert!(ids.insert(id.to_owned()), "operationId {id} twice");
        }
    }
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    for reference in refs {
        let pointer = reference.strip_prefix('#').expect("a local $ref");
        assert!(
            doc.pointer(pointer).is_some(),
            "$ref {reference} resolves to nothing"
        );
    }
}

fn collect_refs(value: &Value, refs: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("$ref", Value::String(reference)) => refs.push(reference.clone()),
                    _ => collect_refs(value, refs),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_refs(item, refs)),
        _ => {}
    }
}

#[test]
fn a_real_server_answers_every_documented_operation_and_refuses_every_other_method() {
    let scratch = Scratch(temp_dir("openapi"));
    let mut server = serve(
        &scratch.0.join("data"),
        json!({"f": {"command": FAULT_HARNESS}}),
        &[],
    );
    let doc = document();
    let id = server.create("f", json!({}));
    for (template, methods) in documented(&doc) {
        let path = template.replace("{session_id}", &id);
        for method in METHODS {
            let body =
                matches!(method, "POST" | "PUT" | "PATCH").then(|| match template.as_str() {
                    "/v1/sessions" => json!({"agentloop": {"name": "f"}}),
                    t if t.ends_with("/messages") => {
                        json!({"content": [{"type": "text", "text": "hi"}]})
                    }
                    t if t.ends_with("/events") => json!({"type": "note"}),
                    _ => json!({}),
                });
            let reply = server.call(method, &path, body);
            if methods.contains(method) {
                let no_route = reply.status == 404 && reply.text().contains("no route");
                assert!(
                    !no_route && reply.status != 405,
                    "{method} {path}: documented, answered {} {}",
                    reply.status,
                    reply.text()
                );
            } else {
                assert_eq!(reply.status, 405, "{method} {path}: {}", reply.text());
                let allowed: BTreeSet<String> = reply
                    .header("allow")
                    .unwrap_or_default()
                    .split(", ")
                    .map(str::to_owned)
                    .collect();
                assert_eq!(allowed, methods, "{method} {path}: Allow");
            }
        }
        // Authentication: only where the document says so.
        for method in &methods {
            let operation = &doc["paths"][&template][method.to_lowercase()];
            let open = operation["security"] == json!([]);
            let raw = encode(method, &path, &[], b"");
            let reply = server.exchange(&raw);
            assert_eq!(
                reply.status == 401,
                !open,
                "{method} {path} without a token answered {} {}",
                reply.status,
                reply.text()
            );
        }
    }

    // The document itself, byte for byte, without a token.
    let reply = server
        .exchange(&encode("GET", "/v1/openapi.yaml", &[], b""))
        .expect(200, None);
    assert_eq!(reply.header("content-type"), Some("application/yaml"));
    let file = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml"))
        .expect("docs/openapi.yaml");
    assert!(
        reply.body == file,
        "the served document is not docs/openapi.yaml"
    );
    server.terminate(WAIT);
}
