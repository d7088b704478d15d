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
    /// The HTTP server's limits (`--http-threads`, `--http-queue`, `--http-read-timeout`).
    pub http: HttpOptions,
}

/// Runs the server until a signal stops it. A signal during startup aborts it. After that, the
/// first SIGTERM or SIGINT drains (new work refused, running activations finish within the drain
/// window, then the rest is cancelled, the workers are stopped, the journal is flushed and the
/// lock released); a second one skips the drain.
pub fn serve(serve: Serve) -> ExitCode {
    let mut signals = match Signals::new([SIGTERM, SIGINT]) {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("brain: installing signal handlers: {error}");
            return ExitCode::FAILURE;
        }
    };
    // One thread turns signals into messages, from before startup to the end.
    let handle = signals.handle();
    let (signal_tx, signal_rx) = crossbeam_channel::unbounded::<()>();
    let forwarder = std::thread::Builder::new()
        .name("brain-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                log::warn!("received signal {signal}");
                if signal_tx.send(()).is_err() {
                    return;
                }
            }
        });
    if let Err(error) = forwarder {
        eprintln!("brain: starting the signal thread: {error}");
        return ExitCode::FAILURE;
    }
    let data_dir = serve.config.options.data_dir.clone();
    let grace = serve.config.options.cancel_grace;
    let brain = match brain::Brain::start_until(serve.config, &signal_rx) {
        Ok(brain) => Arc::new(brain),
        Err(error) if error.aborted() => {
            log::warn!("startup aborted by a signal");
            handle.close();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            handle.close();
            return super::report_start_error(&error);
        }
    };
    let token = match load_or_create_token(&data_dir) {
        Ok(token) => token,
        Err(error) => {
            eprintln!(
                "brain: the API token ({}): {error}",
                data_dir.join("operator.token").display()
            );
            brain.shutdown(grace);
            handle.close();
            return ExitCode::FAILURE;
        }
    };
    let server = match HttpServer::start(brain.clone(), &serve.listen, token, serve.http.clone()) {
        Ok(server) => server,
        Err(error) => {
            eprintln!("brain: listening on {}: {error}", serve.listen);
            brain.shutdown(grace);
            handle.close();
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
    let mut seen = 0;
    loop {
        crossbeam_channel::select! {
            recv(signal_rx) -> signal => {
                if signal.is_err() {
                    break;
                }
                seen += 1;
                let first = seen == 1;
                log::warn!(
                    "{}",
                    if first {
                        "shutting down: draining (a second signal skips the drain)"
                    } else {
                        "skipping the drain"
                    }
                );
                let (brain, stopped_tx) = (brain.clone(), stopped_tx.clone());
                let drain = if first { serve.drain } else { Duration::ZERO };
                std::thread::spawn(move || {
                    brain.shutdown_after(drain, grace);
                    let _ = stopped_tx.send(());
                });
            }
            // A shutdown has completed: every worker reaped, the journal flushed.
            recv(stopped) -> _ => break,
        }
    }
    handle.close();
    server.stop();
    drop(brain);
    log::info!("stopped");
    ExitCode::SUCCESS
}
