//! `brain serve`: the HTTP API over a durable Brain, with graceful shutdown on SIGTERM/SIGINT.

use brain::Config;
use brain::http::{HttpOptions, HttpServer, load_or_create_token};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// What `serve` needs beyond a Brain configuration.
pub struct Serve {
    pub config: Config,
    pub listen: String,
    pub drain: Duration,
}

/// Runs the server until a signal stops it. The first SIGTERM or SIGINT drains (new work refused,
/// running activations finish within the drain window, then the rest is cancelled, the workers
/// are stopped, the journal is flushed and the lock released); a second one skips the drain.
pub fn serve(serve: Serve) -> ExitCode {
    let signals = match Signals::new([SIGTERM, SIGINT]) {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("brain: installing signal handlers: {error}");
            return ExitCode::FAILURE;
        }
    };
    let data_dir = serve.config.options.data_dir.clone();
    let grace = serve.config.options.cancel_grace;
    let brain = match super::start_config(serve.config) {
        Ok(brain) => Arc::new(brain),
        Err(code) => return code,
    };
    let token = match load_or_create_token(&data_dir) {
        Ok(token) => token,
        Err(error) => {
            eprintln!(
                "brain: the API token ({}): {error}",
                data_dir.join("operator.token").display()
            );
            brain.shutdown(grace);
            return ExitCode::FAILURE;
        }
    };
    let server =
        match HttpServer::start(brain.clone(), &serve.listen, token, HttpOptions::default()) {
            Ok(server) => server,
            Err(error) => {
                eprintln!("brain: listening on {}: {error}", serve.listen);
                brain.shutdown(grace);
                return ExitCode::FAILURE;
            }
        };
    log::info!(
        "serving on http://{} (data directory {}); ready: {}",
        server.local_addr(),
        data_dir.display(),
        brain.ready()
    );
    let (stopped_tx, stopped) = crossbeam_channel::unbounded::<()>();
    let handle = signals.handle();
    let watcher = {
        let (brain, drain) = (brain.clone(), serve.drain);
        std::thread::Builder::new()
            .name("brain-signals".into())
            .spawn(move || {
                let mut signals = signals;
                for (seen, signal) in signals.forever().enumerate() {
                    let first = seen == 0;
                    log::warn!(
                        "received signal {signal}: {}",
                        if first {
                            "shutting down (a second signal skips the drain)"
                        } else {
                            "skipping the drain"
                        }
                    );
                    let (brain, stopped_tx) = (brain.clone(), stopped_tx.clone());
                    let drain = if first { drain } else { Duration::ZERO };
                    std::thread::spawn(move || {
                        brain.shutdown_after(drain, grace);
                        let _ = stopped_tx.send(());
                    });
                }
            })
    };
    if let Err(error) = watcher {
        eprintln!("brain: starting the signal thread: {error}");
        brain.shutdown(grace);
        return ExitCode::FAILURE;
    }
    // Returns when a shutdown has completed: every worker reaped, the journal flushed.
    let _ = stopped.recv();
    handle.close();
    server.stop();
    drop(brain);
    log::info!("stopped");
    ExitCode::SUCCESS
}
