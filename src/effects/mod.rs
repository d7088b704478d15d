//! Effects: the model providers and environment drivers that do what a harness asks for.
//!
//! A harness never talks to a model or a tool itself: it asks Brain through `brain/call` (`model`,
//! `tool`, `environments.*`), and Brain performs the effect across a durable journal barrier
//! (docs/PROTOCOL.md §7.4): it makes the `*_started` record durable, calls the provider or driver
//! **exactly once** (never retried, never sent to another target), makes the `*_finished` record
//! durable, then answers the callback.
//!
//! Embedders plug in their own effects by implementing [`ModelProvider`] or [`EnvironmentDriver`]
//! and registering them by name in [`Effects`]. Both traits are synchronous: a call blocks the
//! thread Brain runs it on (never the dispatcher) until it is done, and must return promptly once
//! its [`CancelToken`] is cancelled. What an implementation returns decides what the journal says:
//! [`EffectError`] distinguishes "definitely did not happen" from "may have happened", which is the
//! difference between a clean failure and an `unknown` outcome that must never be resent.
//!
//! The built-in [`ScriptedProvider`] (name `scripted`) is the default model provider.

pub mod anthropic;
pub mod local;
pub mod openai;
pub mod sandbox;
mod scripted;

pub use anthropic::AnthropicProvider;
pub use local::LocalDriver;
pub use openai::OpenAiProvider;
pub use sandbox::SandboxDriver;
pub use scripted::ScriptedProvider;

use crate::cancel::CancelToken;
use crate::protocol::harness::{ErrorCode, ModelMetadata, ModelRequest, ModelResult, ToolResult};
use crate::session::SessionId;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a provider learns about one model call.
///
/// Everything here is borrowed from Brain for the duration of [`ModelProvider::call`].
#[derive(Debug, Clone, Copy)]
pub struct ModelCall<'a> {
    /// The session making the call.
    pub session_id: &'a SessionId,
    /// The sequence of the call's `model_call_started` record: it names this effect for good
    /// (a provider may use it as an idempotency key with a remote service).
    pub sequence: u64,
    /// How many model calls this session made before this one, counted from the journal (so it
    /// survives restarts); 0 for the first. Deterministic providers index by it.
    pub ordinal: u64,
    /// The session's model metadata (`provider`, `name`, limits, and every other key, such as
    /// `options`, in [`ModelMetadata::extra`]). Never credentials: a provider keeps those itself.
    pub model: &'a ModelMetadata,
    /// The request, with the session's `system` and `tools` already filled in where the harness
    /// left them absent.
    pub request: &'a ModelRequest,
}

/// A model provider: turns a [`ModelRequest`] into a [`ModelResult`].
///
/// Brain calls it once per `model` callback, after the `model_call_started` record is durable, on a
/// thread of its own (never the dispatcher), and concurrently for different calls: an
/// implementation must be `Send + Sync` and keep any per-call state on the stack.
pub trait ModelProvider: Send + Sync {
    /// Performs the call, blocking until the model has answered or the call has failed.
    ///
    /// Must return promptly with [`EffectError::Cancelled`] once `cancel` is cancelled (register an
    /// [`on_cancel`](CancelToken::on_cancel) hook to interrupt a blocking read, or wait with
    /// [`wait_timeout`](CancelToken::wait_timeout) instead of sleeping). Usage counters the model
    /// did not report must stay `None`: never zero-filled, never estimated.
    ///
    /// The error says whether anything may have happened: [`EffectError::Failed`] only when the
    /// request was definitely not processed, [`EffectError::Unknown`] when it was sent and the
    /// answer was lost. Brain never retries either.
    fn call(&self, call: &ModelCall<'_>, cancel: &CancelToken) -> Result<ModelResult, EffectError>;

    /// Whether every [`call`](ModelProvider::call) returns at once: computed in memory, with no
    /// I/O, no sleep and no wait on another thread. The default, `false`, is right for anything
    /// that talks to a model.
    ///
    /// Brain's callback threads share one queue. A thread about to make a call that may block
    /// first wakes another for the work queued behind it; one about to make a call that answers
    /// at once does not, and takes the next job itself afterwards, which spares a wake-up per
    /// call. A provider that says `true` and then blocks delays the callbacks queued behind it
    /// (never loses them).
    fn answers_at_once(&self) -> bool {
        false
    }
}

/// Why an effect did not produce its result. Decides the `*_finished` record's outcome and the
/// callback's error code.
#[derive(Debug, Clone, PartialEq)]
pub enum EffectError {
    /// The effect definitely did not happen: nothing was sent, or the other side cleanly refused.
    /// The callback fails with `code` (an [`ErrorCode`], typically [`ErrorCode::ModelFailed`] or
    /// [`ErrorCode::ToolFailed`]) and `message`.
    Failed {
        /// The error code the callback fails with.
        code: ErrorCode,
        /// What went wrong, for the harness and the journal.
        message: String,
    },
    /// The effect may or may not have happened: it was sent, then the connection or a deadline
    /// broke. Recorded as `unknown`; a `model` callback fails `outcome_unknown`, a started tool
    /// answers with outcome `unknown`. Never resent.
    Unknown {
        /// What is known about how it broke.
        message: String,
    },
    /// The call was stopped because its [`CancelToken`] was cancelled.
    Cancelled {
        /// Whether anything had been sent before the cancel: `false` means the effect definitely
        /// did not happen (recorded `cancelled`), `true` that it may have (recorded `unknown`).
        sent: bool,
    },
}

impl fmt::Display for EffectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EffectError::Failed { code, message } => write!(f, "{code}: {message}"),
            EffectError::Unknown { message } => write!(f, "outcome unknown: {message}"),
            EffectError::Cancelled { sent: false } => {
                f.write_str("cancelled before anything was sent")
            }
            EffectError::Cancelled { sent: true } => f.write_str("cancelled after it was sent"),
        }
    }
}

impl std::error::Error for EffectError {}

/// An environment as a session declared it (PROTOCOL.md §9).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvironmentSpec {
    /// The environment's name within the session.
    pub name: String,
    /// The name of the [`EnvironmentDriver`] that runs it, as registered in [`Effects`].
    pub driver: String,
    /// The driver-specific configuration, as the session declared it.
    pub configuration: Map<String, Value>,
}

/// What a driver learns about one tool call.
///
/// Everything here is borrowed from Brain for the duration of [`EnvironmentDriver::call_tool`].
#[derive(Debug, Clone, Copy)]
pub struct ToolCall<'a> {
    /// The session making the call.
    pub session_id: &'a SessionId,
    /// The sequence of the call's `tool_call_started` record: it names this effect for good.
    pub sequence: u64,
    /// The environment the tool runs in (the placement the harness chose, or the tool's first).
    pub environment: &'a EnvironmentSpec,
    /// The environment's current incarnation: the sequence of the record that last set it up.
    pub incarnation: u64,
    /// The declared tool's name.
    pub tool: &'a str,
    /// The tool's input, as the harness sent it.
    pub input: &'a Value,
    /// The session's workspaces, `<data>/workspaces/<session_id>`: a tool that runs on the Brain
    /// host runs in its environment's directory beneath it ([`ToolCall::workspace`]), never in the
    /// harness's native state. Nothing is created until a driver creates it.
    pub workspace_dir: &'a Path,
}

impl ToolCall<'_> {
    /// The environment's own workspace, `<data>/workspaces/<session_id>/<environment>`: where
    /// built-in drivers run a tool unless the deployment allowed the environment another root.
    /// Environment names are path-safe (the request check refuses `.` and `..`).
    pub fn workspace(&self) -> PathBuf {
        self.workspace_dir.join(&self.environment.name)
    }
}

/// An environment driver: runs tools in, sets up, and answers driver-specific calls for the
/// environments that name it.
///
/// Brain calls it after the `*_started` record is durable, on a thread of its own (never the
/// dispatcher), and concurrently for different calls and sessions: an implementation must be
/// `Send + Sync`. Every method blocks until done and must return promptly once its `cancel` token
/// is cancelled. Only [`call_tool`](EnvironmentDriver::call_tool) is required.
pub trait EnvironmentDriver: Send + Sync {
    /// Runs one tool call, blocking until it has ended.
    ///
    /// Once anything started, the outcome is a [`ToolResult`] whose `outcome` says how it ended
    /// (`ok`, `error`, `timeout`, `cancelled`, `unknown`). Return `Err` only when the tool never
    /// started (Brain answers `tool_failed`); an `Err` of [`EffectError::Unknown`] or
    /// `Cancelled { sent: true }` is turned into a ToolResult with outcome `unknown`.
    fn call_tool(
        &self,
        call: &ToolCall<'_>,
        cancel: &CancelToken,
    ) -> Result<ToolResult, EffectError>;

    /// Whether every [`call_tool`](EnvironmentDriver::call_tool) returns at once, computed in
    /// memory without I/O or waiting; see [`ModelProvider::answers_at_once`]. The default,
    /// `false`, is right for every driver that runs something.
    fn answers_at_once(&self) -> bool {
        false
    }

    /// Creates or re-creates `environment` for `session_id` (`environments.setup`), blocking until
    /// done. The default does nothing and succeeds: for drivers with nothing to set up.
    fn setup(
        &self,
        environment: &EnvironmentSpec,
        session_id: &SessionId,
        cancel: &CancelToken,
    ) -> Result<(), EffectError> {
        let _ = (environment, session_id, cancel);
        Ok(())
    }

    /// Performs a driver-specific `method` on `environment` (`environments.call`), blocking until
    /// done. The default knows no method and refuses every one with
    /// [`EffectError::Failed`] and [`ErrorCode::InvalidInput`] (nothing happened).
    fn call(
        &self,
        environment: &EnvironmentSpec,
        method: &str,
        input: &Value,
        cancel: &CancelToken,
    ) -> Result<Value, EffectError> {
        let _ = (input, cancel);
        Err(EffectError::Failed {
            code: ErrorCode::InvalidInput,
            message: format!(
                "unknown method {method:?} for environment {:?} (driver {:?})",
                environment.name, environment.driver
            ),
        })
    }

    /// Checks an environment's configuration when a session declares it, so that a bad one is
    /// refused at creation (`invalid_request`, with this message) rather than at the first call.
    /// The default accepts everything.
    fn validate(&self, configuration: &Map<String, Value>) -> Result<(), String> {
        let _ = configuration;
        Ok(())
    }

    /// A short status for `environments.list` and `environments.get`. Must not block for long:
    /// it is not cancellable. The default is `"ready"`.
    fn status(&self, environment: &EnvironmentSpec) -> String {
        let _ = environment;
        "ready".to_owned()
    }
}

/// Model providers and environment drivers by name: what Brain may use to perform effects.
///
/// A session's `model.provider` names a provider, an environment's `driver` names a driver; a name
/// that is not registered makes the effect fail cleanly (nothing happened). `Effects::default()`
/// has the built-in [`ScriptedProvider`] as `scripted` (with no global script, so it echoes) and the
/// built-in [`LocalDriver`] as `local`; [`Effects::with_env_providers`] adds the OpenAI and
/// Anthropic providers whose keys are set in Brain's environment. A clone copies the name tables and shares the providers and drivers themselves (they
/// are behind [`Arc`]s).
#[derive(Clone)]
pub struct Effects {
    providers: HashMap<String, Arc<dyn ModelProvider>>,
    drivers: HashMap<String, Arc<dyn EnvironmentDriver>>,
}

impl Default for Effects {
    fn default() -> Effects {
        Effects {
            providers: HashMap::new(),
            drivers: HashMap::new(),
        }
        .with_provider(ScriptedProvider::NAME, Arc::new(ScriptedProvider::new()))
        .with_driver(LocalDriver::NAME, Arc::new(LocalDriver::new()))
    }
}

impl Effects {
    /// Adds `openai` when `OPENAI_API_KEY` is set and `anthropic` when `ANTHROPIC_API_KEY` is
    /// (base URLs from `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL`). Keys stay in Brain: they are
    /// never passed to harnesses, journaled or logged.
    pub fn with_env_providers(self) -> Effects {
        let mut effects = self;
        if let Ok(provider) = OpenAiProvider::from_env() {
            effects = effects.with_provider(OpenAiProvider::NAME, Arc::new(provider));
        }
        if let Ok(provider) = AnthropicProvider::from_env() {
            effects = effects.with_provider(AnthropicProvider::NAME, Arc::new(provider));
        }
        effects
    }

    /// The provider registered as `name`, if any.
    pub fn provider(&self, name: &str) -> Option<Arc<dyn ModelProvider>> {
        self.providers.get(name).cloned()
    }

    /// The driver registered as `name`, if any.
    pub fn driver(&self, name: &str) -> Option<Arc<dyn EnvironmentDriver>> {
        self.drivers.get(name).cloned()
    }

    /// Registers `provider` as `name`, replacing any provider already registered under that name
    /// (including the built-in `scripted`).
    pub fn with_provider(
        mut self,
        name: impl Into<String>,
        provider: Arc<dyn ModelProvider>,
    ) -> Self {
        self.providers.insert(name.into(), provider);
        self
    }

    /// Registers `driver` as `name`, replacing any driver already registered under that name.
    pub fn with_driver(
        mut self,
        name: impl Into<String>,
        driver: Arc<dyn EnvironmentDriver>,
    ) -> Self {
        self.drivers.insert(name.into(), driver);
        self
    }
}

impl fmt::Debug for Effects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut providers: Vec<&str> = self.providers.keys().map(String::as_str).collect();
        providers.sort_unstable();
        let mut drivers: Vec<&str> = self.drivers.keys().map(String::as_str).collect();
        drivers.sort_unstable();
        f.debug_struct("Effects")
            .field("providers", &providers)
            .field("drivers", &drivers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{Block, Message, Role, StopReason, ToolOutcome, Usage};
    use serde_json::json;
    use std::time::Duration;

    fn session() -> SessionId {
        SessionId::parse("ses_0123456789ABCDEFGHIJ").expect("a valid id")
    }

    fn model() -> ModelMetadata {
        ModelMetadata {
            provider: "slow".into(),
            name: "test".into(),
            context_window: None,
            max_output_tokens: None,
            extra: Map::new(),
        }
    }

    fn request() -> ModelRequest {
        ModelRequest {
            system: None,
            messages: vec![Message::text(Role::User, "hi")],
            tools: None,
            max_output_tokens: None,
            options: None,
        }
    }

    /// A driver that only implements the required method: proves the trait is implementable and
    /// the defaults are what they say.
    struct Upper;

    impl EnvironmentDriver for Upper {
        fn call_tool(
            &self,
            call: &ToolCall<'_>,
            cancel: &CancelToken,
        ) -> Result<ToolResult, EffectError> {
            if cancel.is_cancelled() {
                return Err(EffectError::Cancelled { sent: false });
            }
            let text = call.input.as_str().unwrap_or_default().to_uppercase();
            Ok(ToolResult {
                outcome: ToolOutcome::Ok,
                content: vec![Block::text(format!("{}:{text}", call.tool))],
                is_error: false,
            })
        }
    }

    /// A provider that blocks until cancelled, as a network provider would after sending.
    struct Slow;

    impl ModelProvider for Slow {
        fn call(
            &self,
            _: &ModelCall<'_>,
            cancel: &CancelToken,
        ) -> Result<ModelResult, EffectError> {
            if cancel.wait_timeout(Duration::from_secs(60)) {
                return Err(EffectError::Cancelled { sent: true });
            }
            Ok(ModelResult {
                message: Message::text(Role::Assistant, "late"),
                stop_reason: StopReason::EndTurn,
                usage: Usage::default(),
                model: None,
            })
        }
    }

    #[test]
    fn the_default_effects_have_the_scripted_provider_and_the_local_driver() {
        let effects = Effects::default();
        assert!(effects.provider("scripted").is_some());
        assert!(effects.provider("openai").is_none());
        assert!(effects.driver("local").is_some());
        assert_eq!(
            format!("{effects:?}"),
            r#"Effects { providers: ["scripted"], drivers: ["local"] }"#
        );
    }

    #[test]
    fn a_driver_with_only_call_tool_gets_the_documented_defaults() {
        let effects = Effects::default().with_driver("upper", Arc::new(Upper));
        let driver = effects.driver("upper").expect("registered");
        let environment = EnvironmentSpec {
            name: "box".into(),
            driver: "upper".into(),
            configuration: Map::new(),
        };
        let id = session();
        let input = json!("shout");
        let cancel = CancelToken::new();
        let call = ToolCall {
            session_id: &id,
            sequence: 7,
            environment: &environment,
            incarnation: 1,
            tool: "say",
            input: &input,
            workspace_dir: Path::new("/tmp"),
        };
        let result = driver.call_tool(&call, &cancel).expect("the tool ran");
        assert_eq!(result.content, vec![Block::text("say:SHOUT")]);
        assert_eq!(driver.setup(&environment, &id, &cancel), Ok(()));
        assert_eq!(driver.status(&environment), "ready");
        match driver.call(&environment, "snapshot", &json!({}), &cancel) {
            Err(EffectError::Failed { code, message }) => {
                assert_eq!(code, ErrorCode::InvalidInput);
                assert!(
                    message.starts_with("unknown method \"snapshot\""),
                    "{message}"
                );
            }
            other => panic!("expected an unknown-method failure, got {other:?}"),
        }
        cancel.cancel();
        assert_eq!(
            driver.call_tool(&call, &cancel),
            Err(EffectError::Cancelled { sent: false })
        );
    }

    #[test]
    fn a_registered_provider_replaces_one_of_the_same_name_and_honours_cancel() {
        let effects = Effects::default().with_provider("scripted", Arc::new(Slow));
        let provider = effects.provider("scripted").expect("registered");
        let (id, model, request) = (session(), model(), request());
        let cancel = CancelToken::new();
        let canceller = {
            let cancel = cancel.clone();
            std::thread::spawn(move || cancel.cancel())
        };
        let call = ModelCall {
            session_id: &id,
            sequence: 3,
            ordinal: 0,
            model: &model,
            request: &request,
        };
        assert_eq!(
            provider.call(&call, &cancel),
            Err(EffectError::Cancelled { sent: true })
        );
        assert!(canceller.join().expect("the canceller ran"));
    }

    #[test]
    fn effect_errors_display_what_happened() {
        let failed = EffectError::Failed {
            code: ErrorCode::ModelFailed,
            message: "refused".into(),
        };
        assert_eq!(failed.to_string(), "model_failed: refused");
        let unknown = EffectError::Unknown {
            message: "connection reset".into(),
        };
        assert_eq!(unknown.to_string(), "outcome unknown: connection reset");
        assert_eq!(
            EffectError::Cancelled { sent: false }.to_string(),
            "cancelled before anything was sent"
        );
    }
}
