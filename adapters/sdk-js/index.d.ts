// Types of @brain/harness-sdk (index.mjs): the harness SDK and the brain/harness/v1 payloads
// (docs/PROTOCOL.md; the Rust types in brain-protocol/src/harness.rs are the reference).

/** The protocol name a harness answers `initialize` with. */
export const PROTOCOL: "brain/harness/v1";

// ----- payloads ----------------------------------------------------------------------------

/** A content block (PROTOCOL.md §8), tagged by `type`. */
export type Block =
  | { type: "text"; text: string }
  | { type: "image"; url: string }
  | { type: "file"; media_type: string; url: string }
  | { type: "tool_use"; id: string; name: string; input: unknown }
  | { type: "tool_result"; tool_use_id: string; content: Block[]; is_error?: boolean }
  | { type: "native"; format: string; data: unknown };

/** A message of the transcript. */
export interface Message {
  role: "user" | "assistant" | "developer";
  content: Block[];
}

/** What the user sent with an activation. */
export interface UserInput {
  content: Block[];
}

/** A journal event a harness may read (`events.read`, `input.events`). */
export interface Event {
  sequence: number;
  type: string;
  data: unknown;
  [key: string]: unknown;
}

/** The session's model: provider, name, limits and provider-specific keys. */
export interface ModelMetadata {
  provider: string;
  name: string;
  context_window?: number;
  max_output_tokens?: number;
  [key: string]: unknown;
}

/** A tool the session declares, as the model sees it. */
export interface ToolDefinition {
  name: string;
  description?: string;
  input_schema: Record<string, unknown>;
  placements?: string[];
}

/** A `model` callback's request. */
export interface ModelRequest {
  messages: Message[];
  system?: string;
  tools?: ToolDefinition[];
  [key: string]: unknown;
}

/** Token counts; a counter the provider did not report is absent. */
export interface Usage {
  input_tokens?: number;
  output_tokens?: number;
  cache_read_tokens?: number;
  cache_write_tokens?: number;
}

/** A `model` callback's answer. */
export interface ModelResult {
  message: Message;
  stop_reason: "end_turn" | "tool_use" | "max_tokens" | "stop_sequence" | "refusal" | string;
  usage: Usage;
  [key: string]: unknown;
}

/** How a tool call ended. */
export interface ToolResult {
  outcome: "ok" | "error" | "timeout" | "cancelled" | "unknown";
  content: Block[];
  is_error: boolean;
}

/** An environment, as `environments.list` / `environments.get` show it. */
export interface EnvironmentInfo {
  name: string;
  driver: string;
  status: string;
  [key: string]: unknown;
}

/** `initialize`'s params. */
export interface InitializeParams {
  protocol: string;
  configuration: Record<string, unknown>;
  [key: string]: unknown;
}

/** What a harness declares in `initialize` (PROTOCOL.md §5). */
export interface InitializeResult {
  protocol: typeof PROTOCOL | string;
  identity: { name: string; version: string };
  state_version: string;
  capabilities?: {
    media?: boolean;
    transcript_import?: boolean;
    fixed_tool_catalogue?: boolean;
    [key: string]: unknown;
  };
  configuration_keys?: string[];
  required_model_metadata?: string[];
}

/** `run`'s params: one activation. */
export interface RunParams {
  session_id: string;
  sequence: number;
  state_dir: string;
  model: ModelMetadata;
  input: {
    input?: UserInput;
    transcript: Message[];
    kv: Record<string, unknown>;
    events: Event[];
    tools: ToolDefinition[];
    system?: string;
    configuration: Record<string, unknown>;
    [key: string]: unknown;
  };
}

// ----- errors ------------------------------------------------------------------------------

/** An error the harness answers `run` with: `code` becomes `data.code` (`[a-z0-9_.]`, ≤ 64). */
export class HarnessError extends Error {
  constructor(code: string, message?: string);
  code: string;
}

/** Brain's error answer to a `brain/call`: `code` (data.code), `fatal` (data.fatal), `rpcCode`. */
export class CallError extends Error {
  constructor(code: string, message: string, fatal?: boolean, rpcCode?: number);
  code: string;
  fatal: boolean;
  rpcCode: number;
}

/** The error a cancelled activation answers `run` with. */
export function cancelledError(): HarnessError;

// ----- the activation context --------------------------------------------------------------

/** What `run` gets: the activation's params and Brain's callbacks. */
export interface Context {
  params: RunParams;
  sessionId: string;
  sequence: number;
  stateDir: string;
  model: ModelMetadata;
  input: RunParams["input"];
  /**
   * Aborted when Brain sends `cancel` or a callback fails with a fatal error. After a fatal error
   * other than `cancelled`, every callback is refused `activation_closed` without being sent.
   */
  signal: AbortSignal;
  /** Any `brain/call`: answers its result object. */
  call(method: string, input?: unknown): Promise<any>;
  kv: {
    /** The value, or `undefined` when the key is absent (a stored null is `null`). */
    get(key: string): Promise<unknown>;
    put(key: string, value: unknown): Promise<unknown>;
    delete(key: string): Promise<unknown>;
  };
  environments: {
    list(): Promise<EnvironmentInfo[]>;
    get(name: string): Promise<EnvironmentInfo>;
    setup(name: string): Promise<unknown>;
    call(name: string, method: string, input: unknown): Promise<unknown>;
  };
  /** `brain/call model`: answers the ModelResult. */
  callModel(request: ModelRequest): Promise<ModelResult>;
  /** `brain/call tool`: answers the ToolResult. */
  callTool(name: string, input: unknown, environment?: string): Promise<ToolResult>;
  emit(type: string, data: unknown): Promise<unknown>;
  transcript: { set(messages: Message[]): Promise<unknown> };
  events: { read(after: number, limit?: number): Promise<{ events: Event[]; next_after?: number }> };
  telemetry(data: unknown): Promise<unknown>;
}

/** A harness: its handlers. `run`'s value becomes `{"result": …}`; `undefined` becomes `{}`. */
export interface Harness {
  initialize(params: InitializeParams): InitializeResult | Promise<InitializeResult>;
  run(ctx: Context): unknown | Promise<unknown>;
  /** After `ctx.signal` was aborted (a cancel, or a fatal callback error), once. */
  cancel?(ctx: Context, reason: unknown, fromCancel: boolean): void | Promise<void>;
  close?(params: { session_id: string; reason: string }): void | Promise<void>;
  shutdown?(): void | Promise<void>;
}

/** Options of `serve`, for tests. */
export interface ServeOptions {
  input?: NodeJS.ReadableStream;
  write?: (line: string) => unknown;
  exit?: (code: number) => void;
}

/** Runs the protocol for `harness` until stdin closes. */
export function serve(harness: Harness, options?: ServeOptions): Promise<void>;

/**
 * Takes stdout for the protocol: returns a function writing one line to the real stdout, and
 * from then on sends console output to stderr. Idempotent.
 */
export function guardStdout(): (line: string) => boolean;

/** Diagnostics on stderr, one line each. */
export function log(...args: unknown[]): void;
