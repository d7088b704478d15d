#!/usr/bin/env node
// agentloop-codex: OpenAI Codex (`codex app-server` from @openai/codex) as a Brain harness
// (brain/harness/v1, docs/PROTOCOL.md), built on ../sdk-js. How it maps Codex onto Brain is told
// in docs/ADAPTERS.md; in short:
//
// - each open Brain session has one `codex app-server` child process, with CODEX_HOME (and HOME)
//   at `<state_dir>/codex`; it is started at the session's first activation in this worker, kept
//   while the session is open, and stopped at `close`, at `shutdown`, and after a run that failed
//   (a failed or cancelled run leaves the session interrupted: it never runs again);
// - the session's Codex thread id is kept in `<state_dir>/brain-codex.json`: a later activation,
//   also in a restarted worker or Brain, resumes that thread with `thread/resume`, so Codex's own
//   rollout files are the continuation;
// - Codex's model provider is a loopback Responses gateway in this process (127.0.0.1, a random
//   port, a random per-process token Codex sends as its provider key): each `POST /v1/responses`
//   becomes exactly one `brain/call model`, and the ModelResult goes back as the SSE events Codex
//   reads. Brain's `native` blocks travel inside Codex reasoning items and come back untouched;
// - the session's tools are Codex dynamic tools, each `item/tool/call` one `brain/call tool`;
//   every Codex built-in tool is disabled, and `request_user_input` (which Codex always offers) is
//   filtered out of every model request;
// - Codex's retries are off (`request_max_retries=0`, `stream_max_retries=0`); compaction is
//   Codex's own, its summarising request goes through the same gateway;
// - `cancel`, or a fatal callback error, interrupts the turn (`turn/interrupt`);
// - the transcript goes to Brain with `transcript.set` before `run` is answered.
//
// `run` answers {"result": {"text": <Codex's last agent message>, "model_calls": <n>,
// "thread_id": <Codex's thread>}}; a failed model call fails the run with its code.
//
// stdout carries protocol lines only: Codex's own stdout is its app-server protocol, read here.

import { spawn } from "node:child_process";
import { randomBytes, timingSafeEqual } from "node:crypto";
import { closeSync, existsSync, fsyncSync, mkdirSync, openSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { CallError, HarnessError, PROTOCOL, guardStdout, log, serve } from "@brain/harness-sdk";

guardStdout();

const ADAPTER_VERSION = "0.1.0";
/** The format of what is kept under `state_dir`: `brain-codex.json` and Codex 0.169's CODEX_HOME. */
const STATE_VERSION = "1";
const CODEX_PACKAGE = "@openai/codex";
const CONFIGURATION_KEYS = ["auto_compact_token_limit"];
/** The provider id Codex knows the gateway by (`openai`, `ollama`, `lmstudio` are reserved). */
const PROVIDER = "brain";
/** The environment variable carrying the gateway token to Codex (its provider `env_key`). */
const TOKEN_VARIABLE = "BRAIN_CODEX_GATEWAY_TOKEN";
/** The Brain `native` blocks ride in a Codex reasoning item's `encrypted_content` behind this. */
const NATIVE_PREFIX = "brain.native.v1:";
/** The tool Codex offers whatever the configuration; it never reaches Brain's model request. */
const FILTERED_TOOLS = new Set(["request_user_input"]);
/** How long to wait for Codex to start, answer a request, or end an interrupted turn. */
const START_TIMEOUT_MS = 20_000;
const REQUEST_TIMEOUT_MS = 20_000;
const INTERRUPT_WAIT_MS = 3_000;
const STOP_WAIT_MS = 2_000;
const DEBUG = process.env.BRAIN_CODEX_DEBUG === "1";

const require = createRequire(import.meta.url);

function codexVersion() {
  try {
    return JSON.parse(readFileSync(require.resolve(`${CODEX_PACKAGE}/package.json`), "utf8")).version;
  } catch {
    return "unknown";
  }
}

/**
 * The native `codex` binary from the platform package npm installed as @openai/codex's optional
 * dependency (the layout its own `bin/codex.js` uses). Resolved here so that no install script is
 * needed (`npm ci --ignore-scripts`) and nothing is fetched at run time.
 */
function codexBinary() {
  const triples = {
    "linux-x64": ["@openai/codex-linux-x64", "x86_64-unknown-linux-musl"],
    "linux-arm64": ["@openai/codex-linux-arm64", "aarch64-unknown-linux-musl"],
    "darwin-x64": ["@openai/codex-darwin-x64", "x86_64-apple-darwin"],
    "darwin-arm64": ["@openai/codex-darwin-arm64", "aarch64-apple-darwin"],
  };
  const platform = triples[`${process.platform}-${process.arch}`];
  if (!platform) throw new Error(`no Codex build for ${process.platform}-${process.arch}`);
  const [pkg, triple] = platform;
  const codexRoot = dirname(require.resolve(`${CODEX_PACKAGE}/package.json`));
  const platformJson = createRequire(join(codexRoot, "package.json")).resolve(`${pkg}/package.json`);
  const binary = join(dirname(platformJson), "vendor", triple, "bin", "codex");
  if (!existsSync(binary)) throw new Error(`${binary} is missing`);
  return { binary, pathDir: join(dirname(platformJson), "vendor", triple, "codex-path") };
}

let binaryError;
let codex;
try {
  codex = codexBinary();
} catch (error) {
  binaryError = error;
  log(`agentloop-codex: the Codex binary is missing (run npm ci in adapters/codex): ${error.message}`);
}

/** Brain session id -> { child, rpc, threadId, activation, stopping, exited } */
const sessions = new Map();

// ---------------------------------------------------------------------------------------------
// The loopback Responses gateway.

const TOKEN = randomBytes(32).toString("hex");
const gateway = startGateway();

function startGateway() {
  const server = createServer((request, response) => {
    handleGateway(request, response).catch((error) => {
      log("agentloop-codex: gateway:", error);
      if (!response.headersSent) sendError(response, 500, "gateway_error", error.message ?? String(error));
      else response.end();
    });
  });
  server.keepAliveTimeout = 1_000;
  const ready = new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => resolve(server.address().port));
  });
  ready.catch((error) => log("agentloop-codex: the gateway cannot listen:", error));
  return { server, ready };
}

function authorized(request) {
  const header = request.headers.authorization ?? "";
  const expected = Buffer.from(`Bearer ${TOKEN}`);
  const given = Buffer.from(header);
  return given.length === expected.length && timingSafeEqual(given, expected);
}

function sendError(response, status, code, message) {
  const body = JSON.stringify({ error: { type: code, code, message } });
  response.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(body) });
  response.end(body);
}

async function readBody(request) {
  const chunks = [];
  for await (const chunk of request) chunks.push(chunk);
  return Buffer.concat(chunks).toString("utf8");
}

async function handleGateway(request, response) {
  if (!authorized(request)) {
    request.resume();
    return sendError(response, 401, "unauthorized", "this gateway serves its own Codex processes only");
  }
  // /<session id>/v1/responses
  const match = /^\/([A-Za-z0-9_]+)\/v1\/([a-z/]+)$/.exec(new URL(request.url, "http://x").pathname);
  if (!match || request.method !== "POST" || match[2] !== "responses") {
    request.resume();
    if (DEBUG) log(`agentloop-codex: gateway: refusing ${request.method} ${request.url}`);
    return sendError(response, 404, "not_found", `no ${request.method} ${request.url} here`);
  }
  const entry = sessions.get(match[1]);
  const activation = entry?.activation;
  const raw = await readBody(request);
  if (!activation) {
    return sendError(response, 409, "no_activation", "a model call outside of an activation: Brain would refuse it");
  }
  let body;
  try {
    body = JSON.parse(raw);
  } catch (error) {
    return sendError(response, 400, "invalid_request", `the request is not JSON: ${error.message}`);
  }
  const kind = requestKind(request.headers["x-codex-turn-metadata"]);
  if (DEBUG) log(`agentloop-codex: gateway: ${kind} request`, body);
  const brainRequest = toBrainRequest(body);
  activation.modelCalls += 1;
  const ctx = activation.ctx;
  let result;
  try {
    if (ctx.signal.aborted) throw ctx.signal.reason;
    const call = ctx.callModel(brainRequest);
    call.catch(() => {});
    // On cancel, answer Codex at once; the SDK still waits for the callback before answering run.
    const aborted = new Promise((_, reject) => {
      ctx.signal.addEventListener("abort", () => reject(ctx.signal.reason), { once: true });
    });
    result = await Promise.race([call, aborted]);
  } catch (error) {
    if (error instanceof CallError) activation.lastCallError = error;
    const code = error?.code ?? "model_failed";
    return sendError(response, 500, code, `brain/call model failed (${code}): ${error?.message ?? error}`);
  }
  activation.exchange(kind, brainRequest, result);
  writeResult(response, result, activation.modelCalls);
}

function requestKind(header) {
  try {
    return JSON.parse(String(header ?? "{}")).request_kind ?? "turn";
  } catch {
    return "turn";
  }
}

/** A Responses request body as a Brain ModelRequest. */
function toBrainRequest(body) {
  const input = Array.isArray(body.input) ? [...body.input] : [];
  const request = {};
  // Codex sends its base instructions (the session's system prompt, or Codex's own) as the first
  // developer message: that is the request's system prompt, so Brain does not add the session's.
  const first = input[0];
  if (typeof body.instructions === "string" && body.instructions !== "") request.system = body.instructions;
  else if (first?.type === "message" && first.role === "developer") {
    request.system = (first.content ?? []).map((part) => part.text ?? "").join("");
    input.shift();
  }
  request.messages = toBrainMessages(input);
  const tools = [];
  for (const tool of body.tools ?? []) {
    if (tool?.type !== "function") {
      if (DEBUG) log(`agentloop-codex: dropping a ${tool?.type} tool from the model request`);
      continue;
    }
    if (FILTERED_TOOLS.has(tool.name)) continue;
    tools.push({ name: tool.name, description: tool.description ?? "", input_schema: tool.parameters ?? { type: "object" } });
  }
  request.tools = tools;
  if (Number.isInteger(body.max_output_tokens)) request.max_output_tokens = body.max_output_tokens;
  return request;
}

/**
 * Responses input items as Brain messages: messages by role, a model turn's reasoning items,
 * assistant messages and function calls as one assistant message (reasoning as the `native`
 * blocks they carry), function call outputs as one user message of `tool_result` blocks.
 */
function toBrainMessages(items) {
  const out = [];
  const push = (role, block, group) => {
    const last = out[out.length - 1];
    if (last && last.role === role && last.group === group && group !== undefined) last.content.push(block);
    else out.push({ role, content: [block], group });
  };
  for (const item of items) {
    switch (item?.type) {
      case "message": {
        if (item.role === "assistant") {
          for (const part of item.content ?? []) {
            if (typeof part.text === "string") push("assistant", { type: "text", text: part.text }, "model");
          }
        } else {
          const role = item.role === "developer" || item.role === "system" ? "developer" : "user";
          const content = [];
          for (const part of item.content ?? []) {
            if (typeof part.text === "string") content.push({ type: "text", text: part.text });
            else if (part.type === "input_image" && typeof part.image_url === "string") {
              content.push({ type: "image", url: part.image_url });
            }
          }
          if (content.length > 0) out.push({ role, content });
        }
        break;
      }
      case "reasoning":
        push("assistant", nativeOf(item), "model");
        break;
      case "function_call":
        push("assistant", { type: "tool_use", id: item.call_id, name: item.name, input: parseArguments(item.arguments) }, "model");
        break;
      case "function_call_output":
        push("user", { type: "tool_result", tool_use_id: item.call_id, content: outputBlocks(item.output), is_error: false }, "tools");
        break;
      default:
        if (DEBUG) log(`agentloop-codex: dropping a ${item?.type} input item`);
    }
  }
  return out.map(({ role, content }) => ({ role, content }));
}

/** The Brain block a reasoning item carries: the original `native` block, or the item itself. */
function nativeOf(item) {
  const encrypted = item.encrypted_content;
  if (typeof encrypted === "string" && encrypted.startsWith(NATIVE_PREFIX)) {
    try {
      return JSON.parse(encrypted.slice(NATIVE_PREFIX.length));
    } catch {
      // fall through: not one of ours
    }
  }
  return { type: "native", format: "openai.responses.reasoning", data: item };
}

function parseArguments(text) {
  if (typeof text !== "string") return text ?? {};
  try {
    return JSON.parse(text);
  } catch {
    return { arguments: text };
  }
}

function outputBlocks(output) {
  if (typeof output === "string") return [{ type: "text", text: output }];
  const blocks = [];
  for (const part of Array.isArray(output) ? output : (output?.content ?? [])) {
    if (typeof part.text === "string") blocks.push({ type: "text", text: part.text });
    else if (part.type === "input_image" && typeof part.image_url === "string") blocks.push({ type: "image", url: part.image_url });
  }
  return blocks;
}

/** A ModelResult as the Responses SSE stream Codex reads, then the end of the stream. */
function writeResult(response, result, ordinal) {
  const id = `resp_brain_${ordinal}_${randomBytes(6).toString("hex")}`;
  response.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache", connection: "close" });
  const event = (data) => response.write(`event: ${data.type}\ndata: ${JSON.stringify(data)}\n\n`);
  event({ type: "response.created", response: { id } });
  const blocks = Array.isArray(result?.message?.content) ? result.message.content : [];
  let index = 0;
  for (const block of blocks) {
    const item = outputItem(block, `${id}_${index}`);
    if (!item) continue;
    event({ type: "response.output_item.added", output_index: index, item });
    if (item.type === "message") {
      event({ type: "response.output_text.delta", output_index: index, item_id: item.id, content_index: 0, delta: block.text });
    }
    event({ type: "response.output_item.done", output_index: index, item });
    index += 1;
  }
  const completed = { id };
  const usage = codexUsage(result?.usage);
  if (usage) completed.usage = usage;
  event({ type: "response.completed", response: completed });
  response.end();
}

function outputItem(block, id) {
  switch (block?.type) {
    case "text":
      return { type: "message", id: `msg_${id}`, role: "assistant", status: "completed",
               content: [{ type: "output_text", text: block.text, annotations: [] }] };
    case "tool_use":
      return { type: "function_call", id: `fc_${id}`, call_id: block.id, name: block.name,
               arguments: JSON.stringify(block.input ?? {}), status: "completed" };
    case "native":
      // Opaque to Codex, which keeps the item and sends it back in later requests' input.
      return { type: "reasoning", id: `rs_${id}`, summary: [], encrypted_content: NATIVE_PREFIX + JSON.stringify(block) };
    default:
      return undefined;
  }
}

/**
 * Brain's usage as Codex's: only counters Brain reported. Codex's usage object needs input and
 * output counts, so without both there is no usage at all (never zero-filled).
 */
function codexUsage(usage) {
  if (!usage || !Number.isInteger(usage.input_tokens) || !Number.isInteger(usage.output_tokens)) return undefined;
  const cached = (usage.cache_read_input_tokens ?? 0);
  const input = usage.input_tokens + cached + (usage.cache_creation_input_tokens ?? 0);
  const out = { input_tokens: input, output_tokens: usage.output_tokens, total_tokens: input + usage.output_tokens };
  if (Number.isInteger(usage.cache_read_input_tokens)) out.input_tokens_details = { cached_tokens: cached };
  if (Number.isInteger(usage.reasoning_tokens)) out.output_tokens_details = { reasoning_tokens: usage.reasoning_tokens };
  return out;
}

// ---------------------------------------------------------------------------------------------
// The Codex app-server child: JSON-RPC over its stdio.

class CodexProcess {
  constructor(sessionId, home, port, settings) {
    this.sessionId = sessionId;
    this.nextId = 0;
    this.pending = new Map();
    this.turns = new Map(); // turn id -> { resolve, promise, completed }
    this.onRequest = undefined;
    this.onNotification = undefined;
    const args = ["app-server", "--strict-config", ...codexFlags(sessionId, port, settings)];
    this.child = spawn(codex.binary, args, {
      cwd: home,
      env: {
        PATH: `${codex.pathDir}:${process.env.PATH ?? "/usr/bin:/bin"}`,
        HOME: home,
        CODEX_HOME: home,
        LANG: process.env.LANG ?? "C.UTF-8",
        ...(process.env.TZ ? { TZ: process.env.TZ } : {}),
        ...(process.env.TMPDIR ? { TMPDIR: process.env.TMPDIR } : {}),
        [TOKEN_VARIABLE]: TOKEN,
        // Codex's diagnostics go to the worker's stderr, which Brain logs: errors only, uncoloured
        // (a registration's env can set BRAIN_CODEX_RUST_LOG, e.g. to "warn" or "debug").
        RUST_LOG: process.env.BRAIN_CODEX_RUST_LOG ?? "error",
        NO_COLOR: "1",
      },
      stdio: ["pipe", "pipe", "pipe"],
    });
    this.pid = this.child.pid;
    this.exited = new Promise((resolve) => {
      this.child.once("exit", (code, signal) => {
        this.exitStatus = signal ? `signal ${signal}` : `status ${code}`;
        const error = new Error(`codex app-server (pid ${this.pid}) exited with ${this.exitStatus}`);
        for (const waiter of this.pending.values()) waiter.reject(error);
        this.pending.clear();
        for (const turn of this.turns.values()) turn.reject(error);
        resolve(this.exitStatus);
      });
      this.child.once("error", (error) => {
        this.exitStatus = `spawn error ${error.message}`;
        for (const waiter of this.pending.values()) waiter.reject(error);
        this.pending.clear();
        resolve(this.exitStatus);
      });
    });
    this.child.stdin.on("error", () => {});
    createInterface({ input: this.child.stdout, crlfDelay: Infinity }).on("line", (line) => this.receive(line));
    createInterface({ input: this.child.stderr, crlfDelay: Infinity }).on("line", (line) =>
      log(`codex[${sessionId}]: ${line}`),
    );
  }

  get alive() {
    return this.exitStatus === undefined;
  }

  send(message) {
    this.child.stdin.write(`${JSON.stringify(message)}\n`);
  }

  request(method, params, timeoutMs = REQUEST_TIMEOUT_MS) {
    if (!this.alive) return Promise.reject(new Error(`codex app-server exited with ${this.exitStatus}`));
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new Error(`codex app-server did not answer ${method} within ${timeoutMs} ms`));
      }, timeoutMs);
      this.pending.set(id, {
        resolve: (value) => (clearTimeout(timer), resolve(value)),
        reject: (error) => (clearTimeout(timer), reject(error)),
      });
      this.send({ id, method, params });
    });
  }

  notify(method, params) {
    this.send(params === undefined ? { method } : { method, params });
  }

  receive(line) {
    let message;
    try {
      message = JSON.parse(line);
    } catch {
      log(`codex[${this.sessionId}] stdout: ${line}`);
      return;
    }
    if (DEBUG) log(`codex[${this.sessionId}] ->`, message);
    if (typeof message.method === "string" && message.id !== undefined && message.id !== null) {
      Promise.resolve()
        .then(() => this.onRequest?.(message.method, message.params ?? {}))
        .then(
          (result) => this.alive && this.send({ id: message.id, result: result ?? {} }),
          (error) => this.alive && this.send({ id: message.id, error: { code: -32000, message: String(error?.message ?? error) } }),
        );
      return;
    }
    if (typeof message.method === "string") {
      if (message.method === "turn/completed") this.turn(message.params?.turn?.id).resolve(message.params.turn);
      this.onNotification?.(message.method, message.params ?? {});
      return;
    }
    const waiter = this.pending.get(message.id);
    if (!waiter) return;
    this.pending.delete(message.id);
    if (message.error) waiter.reject(new Error(`codex: ${message.error.message ?? JSON.stringify(message.error)}`));
    else waiter.resolve(message.result);
  }

  /** The completion of turn `id`, which may arrive before or after the turn/start answer. */
  turn(id) {
    let turn = this.turns.get(id);
    if (!turn) {
      let resolve;
      let reject;
      const promise = new Promise((res, rej) => ((resolve = res), (reject = rej)));
      promise.catch(() => {});
      turn = { promise, resolve, reject };
      this.turns.set(id, turn);
    }
    return turn;
  }

  async stop() {
    if (!this.alive) return;
    try {
      this.child.stdin.end();
    } catch {
      // already closed
    }
    this.child.kill("SIGTERM");
    const timer = setTimeout(() => this.child.kill("SIGKILL"), STOP_WAIT_MS);
    await this.exited;
    clearTimeout(timer);
  }
}

/** The flags that give Codex the gateway as its only provider and turn everything built in off. */
function codexFlags(sessionId, port, settings) {
  const flags = [];
  for (const feature of [
    "shell_tool", "unified_exec", "view_image", "multi_agent", "goals", "apps", "plugins",
    "shell_snapshot", "memories",
  ]) {
    flags.push("--disable", feature);
  }
  const config = {
    model_provider: JSON.stringify(PROVIDER),
    model: JSON.stringify(settings.model),
    [`model_providers.${PROVIDER}.name`]: '"Brain"',
    [`model_providers.${PROVIDER}.base_url`]: JSON.stringify(`http://127.0.0.1:${port}/${sessionId}/v1`),
    [`model_providers.${PROVIDER}.wire_api`]: '"responses"',
    [`model_providers.${PROVIDER}.env_key`]: JSON.stringify(TOKEN_VARIABLE),
    [`model_providers.${PROVIDER}.request_max_retries`]: "0",
    [`model_providers.${PROVIDER}.stream_max_retries`]: "0",
    [`model_providers.${PROVIDER}.supports_websockets`]: "false",
    model_context_window: String(settings.contextWindow),
    model_auto_compact_token_limit: String(settings.autoCompactTokenLimit),
    web_search: '"disabled"',
    "skills.bundled.enabled": "false",
    include_permissions_instructions: "false",
    include_environment_context: "false",
    include_apps_instructions: "false",
    check_for_update_on_startup: "false",
    project_doc_max_bytes: "0",
    approval_policy: '"never"',
    sandbox_mode: '"read-only"',
  };
  for (const [key, value] of Object.entries(config)) flags.push("-c", `${key}=${value}`);
  return flags;
}

// ---------------------------------------------------------------------------------------------
// Sessions.

function settingsOf(ctx) {
  const { model, input } = ctx;
  if (!Number.isInteger(model.context_window) || !Number.isInteger(model.max_output_tokens)) {
    throw new HarnessError("missing_model_metadata", "model: context_window and max_output_tokens are required (integers)");
  }
  const configuration = input.configuration ?? {};
  for (const key of Object.keys(configuration)) {
    if (!CONFIGURATION_KEYS.includes(key)) {
      throw new HarnessError("invalid_configuration", `configuration: unknown key ${JSON.stringify(key)} (accepted: ${CONFIGURATION_KEYS.join(", ")})`);
    }
  }
  let autoCompactTokenLimit = Math.max(1, model.context_window - model.max_output_tokens);
  const limit = configuration.auto_compact_token_limit;
  if (limit !== undefined && limit !== null) {
    if (!Number.isInteger(limit) || limit <= 0) {
      throw new HarnessError("invalid_configuration", `configuration.auto_compact_token_limit: expected a positive integer, got ${JSON.stringify(limit)}`);
    }
    autoCompactTokenLimit = limit;
  }
  return {
    model: model.name || "default",
    contextWindow: model.context_window,
    autoCompactTokenLimit,
  };
}

/** The session's tools as Codex dynamic tools. */
function dynamicTools(tools) {
  return (tools ?? []).map((tool) => ({
    type: "function",
    name: tool.name,
    description: tool.description ?? "",
    inputSchema: tool.input_schema ?? { type: "object" },
  }));
}

function stateFile(stateDir) {
  return join(stateDir, "brain-codex.json");
}

function readState(stateDir) {
  try {
    return JSON.parse(readFileSync(stateFile(stateDir), "utf8"));
  } catch (error) {
    if (error.code === "ENOENT") return undefined;
    throw new HarnessError("harness_error", `${stateFile(stateDir)}: ${error.message}`);
  }
}

/** Writes the state file durably: a temporary file, fsynced, renamed over it, the directory fsynced. */
function writeState(stateDir, state) {
  const file = stateFile(stateDir);
  const fd = openSync(`${file}.tmp`, "w", 0o600);
  try {
    writeFileSync(fd, JSON.stringify(state));
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  renameSync(`${file}.tmp`, file);
  const dir = openSync(stateDir, "r");
  try {
    fsyncSync(dir);
  } finally {
    closeSync(dir);
  }
}

/**
 * The saved thread of the session, after checking that the session's tools are still those the
 * thread was created with: Codex fixes a thread's dynamic tools, so another catalogue fails
 * explicitly instead of running with stale tools.
 */
function checkCatalogue(stateDir, tools) {
  const saved = readState(stateDir);
  if (saved && !same(saved.tools ?? [], tools)) {
    throw new HarnessError(
      "unsupported_input",
      `the tool catalogue changed since Codex thread ${saved.thread_id} was created (Codex fixes a thread's dynamic tools): ` +
        `was [${(saved.tools ?? []).map((t) => t.name).join(", ")}], now [${tools.map((t) => t.name).join(", ")}]`,
    );
  }
  return saved;
}

/** The session's running Codex with its thread, started (and the thread resumed) when needed. */
async function openSession(ctx) {
  const open = sessions.get(ctx.sessionId);
  if (open?.process.alive) return open;
  if (open) {
    log(`agentloop-codex: session ${ctx.sessionId}: codex exited while idle (${open.process.exitStatus}); restarting it`);
    sessions.delete(ctx.sessionId);
  }
  if (binaryError) throw new HarnessError("harness_error", `agentloop-codex: ${binaryError.message} (run npm ci in adapters/codex)`);
  const { stateDir, input } = ctx;
  if (typeof stateDir !== "string" || stateDir === "") throw new HarnessError("invalid_input", "run: state_dir must be a non-empty string");
  const settings = settingsOf(ctx);
  const tools = dynamicTools(input.tools);
  const saved = checkCatalogue(stateDir, tools);
  const home = join(stateDir, "codex");
  mkdirSync(home, { recursive: true, mode: 0o700 });
  const port = await gateway.ready;
  const proc = new CodexProcess(ctx.sessionId, home, port, settings);
  const entry = { process: proc, threadId: undefined, activation: undefined };
  proc.onRequest = (method, params) => answerCodex(entry, method, params);
  proc.onNotification = (method, params) => entry.activation?.notification(method, params);
  sessions.set(ctx.sessionId, entry);
  try {
    await proc.request(
      "initialize",
      {
        clientInfo: { name: "agentloop-codex", title: "Brain", version: ADAPTER_VERSION },
        capabilities: { experimentalApi: true },
      },
      START_TIMEOUT_MS,
    );
    proc.notify("initialized");
    const common = {
      model: settings.model,
      modelProvider: PROVIDER,
      cwd: stateDir,
      approvalPolicy: "never",
      sandbox: "read-only",
    };
    if (typeof input.system === "string" && input.system !== "") common.baseInstructions = input.system;
    let thread;
    if (saved?.thread_id) {
      thread = (await proc.request("thread/resume", { threadId: saved.thread_id, ...common, excludeTurns: true })).thread;
    } else {
      thread = (await proc.request("thread/start", { ...common, ephemeral: false, dynamicTools: tools })).thread;
      writeState(stateDir, { thread_id: thread.id, tools });
    }
    entry.threadId = thread.id;
    log(`agentloop-codex: session ${ctx.sessionId}: codex pid ${proc.pid}, thread ${thread.id} ${saved ? "resumed" : "started"}`);
  } catch (error) {
    sessions.delete(ctx.sessionId);
    await proc.stop();
    if (error instanceof HarnessError) throw error;
    throw new HarnessError("harness_error", `codex app-server: ${error.message}${proc.exitStatus ? ` (${proc.exitStatus})` : ""}`);
  }
  return entry;
}

async function closeSession(sessionId) {
  const entry = sessions.get(sessionId);
  if (!entry) return;
  sessions.delete(sessionId);
  await entry.process.stop();
}

/** Codex's requests to its client: dynamic tool calls through Brain; everything else declined. */
async function answerCodex(entry, method, params) {
  switch (method) {
    case "item/tool/call":
      return callTool(entry, params);
    case "item/commandExecution/requestApproval":
    case "item/fileChange/requestApproval":
      return { decision: "decline" };
    case "applyPatchApproval":
    case "execCommandApproval":
      return { decision: "denied" };
    case "item/permissions/requestApproval":
      // Grants nothing: the schema's answer is the granted profile, here an empty one.
      return { permissions: {} };
    case "item/tool/requestUserInput":
      return { answers: {} };
    case "mcpServer/elicitation/request":
      return { action: "decline" };
    default:
      throw new Error(`agentloop-codex does not serve ${method}`);
  }
}

async function callTool(entry, params) {
  const activation = entry.activation;
  const name = params.tool;
  if (!activation) return { contentItems: [{ type: "inputText", text: `tool ${name}: no running activation` }], success: false };
  let result;
  try {
    result = await activation.ctx.callTool(name, params.arguments ?? {});
  } catch (error) {
    return { contentItems: [{ type: "inputText", text: `tool ${name} failed (${error.code ?? "error"}): ${error.message}` }], success: false };
  }
  const contentItems = [];
  for (const block of result?.content ?? []) {
    if (block.type === "text") contentItems.push({ type: "inputText", text: block.text });
    else if (block.type === "image" && typeof block.url === "string") contentItems.push({ type: "inputImage", imageUrl: block.url });
    else contentItems.push({ type: "inputText", text: JSON.stringify(block) });
  }
  if (contentItems.length === 0) contentItems.push({ type: "inputText", text: "" });
  const failed = result?.is_error === true || (result?.outcome && result.outcome !== "ok");
  return { contentItems, success: !failed };
}

// ---------------------------------------------------------------------------------------------
// One activation: a Codex turn.

class Turn {
  constructor(ctx, prompt) {
    this.ctx = ctx;
    this.prompt = prompt;
    this.modelCalls = 0;
    this.lastCallError = undefined;
    this.turnId = undefined;
    this.agentText = undefined;
    this.errors = [];
    // The conversation since the prompt, as Brain messages, built from the gateway's exchanges:
    // `log` what this activation added, `view` what the model saw after the prompt last time.
    this.log = [];
    this.view = [];
    this.compacted = false;
  }

  /**
   * A model call through the gateway, for the transcript. Each turn request repeats what the
   * model saw before plus what happened since (tool results): those new messages and the answer
   * are appended to the log. A compaction request rewrites Codex's history: its summary is Codex's
   * private context, not conversation, and the next request is the new baseline.
   */
  exchange(kind, request, result) {
    // A compaction request ends with Codex's summarising prompt: everything before it is history.
    const messages = kind === "compaction" ? request.messages.slice(0, -1) : request.messages;
    let tail = messages;
    for (let i = messages.length - 1; i >= 0; i--) {
      const m = messages[i];
      if (m.role === "user" && m.content.length === 1 && m.content[0].type === "text" && m.content[0].text === this.prompt) {
        tail = messages.slice(i + 1);
        break;
      }
    }
    if (!this.compacted) {
      let common = 0;
      while (common < this.view.length && common < tail.length && same(this.view[common], tail[common])) common += 1;
      this.log.push(...tail.slice(common));
    }
    if (kind === "compaction") {
      this.compacted = true;
      return;
    }
    this.compacted = false;
    const answer = { role: "assistant", content: Array.isArray(result?.message?.content) ? result.message.content : [] };
    this.log.push(answer);
    this.view = [...tail, answer];
  }

  notification(method, params) {
    if (method === "item/completed" && params.item?.type === "agentMessage") this.agentText = params.item.text;
    else if (method === "error") this.errors.push(params.error?.message ?? JSON.stringify(params.error));
  }

  /** The messages this activation added to the conversation. */
  messages() {
    return [{ role: "user", content: [{ type: "text", text: this.prompt }] }, ...this.log];
  }
}

function same(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}

function promptOf(input) {
  const texts = [];
  for (const block of input.input?.content ?? []) {
    if (block.type === "text") texts.push(block.text);
    else throw new HarnessError("unsupported_input", `agentloop-codex accepts text input only, got a ${block.type} block`);
  }
  const events = input.events ?? [];
  if (events.length > 0) texts.push(events.map((e) => `event ${e.type}: ${JSON.stringify(e.data ?? null)}`).join("\n"));
  return texts.join("\n");
}

function withTimeout(promise, ms) {
  let timer;
  return Promise.race([
    promise,
    new Promise((resolve) => (timer = setTimeout(() => resolve(undefined), ms))),
  ]).finally(() => clearTimeout(timer));
}

serve({
  async initialize() {
    if (binaryError) {
      throw new HarnessError("harness_error", `agentloop-codex cannot find the Codex binary (run npm ci in adapters/codex): ${binaryError.message}`);
    }
    try {
      await gateway.ready;
    } catch (error) {
      throw new HarnessError("harness_error", `agentloop-codex: the model gateway cannot listen on 127.0.0.1: ${error.message}`);
    }
    return {
      protocol: PROTOCOL,
      identity: { name: "agentloop-codex", version: `${ADAPTER_VERSION}+codex.${codexVersion()}` },
      state_version: STATE_VERSION,
      capabilities: { media: false, transcript_import: false, fixed_tool_catalogue: true },
      configuration_keys: CONFIGURATION_KEYS,
      required_model_metadata: ["context_window", "max_output_tokens"],
    };
  },

  async run(ctx) {
    const prompt = promptOf(ctx.input);
    // An event-only activation with no events: nothing for Codex to do.
    if (prompt === "") return undefined;
    settingsOf(ctx);
    if (typeof ctx.stateDir === "string" && ctx.stateDir !== "") checkCatalogue(ctx.stateDir, dynamicTools(ctx.input.tools));
    if (ctx.signal.aborted) throw ctx.signal.reason;
    let entry;
    const turn = new Turn(ctx, prompt);
    let failed = true;
    try {
      let started;
      for (let attempt = 0; ; attempt++) {
        entry = await openSession(ctx);
        entry.activation = turn;
        if (ctx.signal.aborted) throw ctx.signal.reason;
        try {
          started = await entry.process.request("turn/start", {
            threadId: entry.threadId,
            input: [{ type: "text", text: prompt, text_elements: [] }],
          });
          break;
        } catch (error) {
          // A Codex that died while idle, before this worker noticed: the turn never started (it
          // made no model call), so start Codex again, once, and resume the thread.
          await withTimeout(entry.process.exited, 1_000);
          if (entry.process.alive || attempt > 0 || turn.modelCalls > 0) throw error;
          entry.activation = undefined;
          log(`agentloop-codex: session ${ctx.sessionId}: codex exited before the turn started (${error.message}); restarting it`);
        }
      }
      const proc = entry.process;
      turn.turnId = started.turn.id;
      if (ctx.signal.aborted) interrupt(entry, turn);
      let completed;
      try {
        completed = await proc.turn(turn.turnId).promise;
      } catch (error) {
        throw new HarnessError("harness_error", `the Codex process died mid-run: ${error.message}`);
      }
      proc.turns.delete(turn.turnId);
      if (turn.modelCalls > 0) await ctx.transcript.set([...(ctx.input.transcript ?? []), ...turn.messages()]);
      if (ctx.signal.aborted) throw ctx.signal.reason;
      if (completed.status !== "completed") {
        const cause = turn.lastCallError;
        const message = completed.error?.message ?? turn.errors.at(-1) ?? `the Codex turn ended ${completed.status}`;
        throw new HarnessError(cause?.code ?? "harness_error", cause ? `${cause.message} (codex: ${message})` : `codex: ${message}`);
      }
      failed = false;
      return { text: turn.agentText ?? "", model_calls: turn.modelCalls, thread_id: entry.threadId };
    } finally {
      if (entry) entry.activation = undefined;
      // A run that did not complete leaves the session interrupted: it never runs again here.
      if (failed && entry) {
        await closeSession(ctx.sessionId).catch((error) => log("agentloop-codex: stopping codex failed:", error));
      }
    }
  },

  // The SDK aborted ctx.signal (cancel, or a fatal callback error): interrupt Codex's turn.
  cancel(ctx) {
    const entry = sessions.get(ctx.sessionId);
    if (entry && entry.activation?.ctx === ctx) interrupt(entry, entry.activation);
  },

  async close({ session_id }) {
    await closeSession(session_id);
  },

  async shutdown() {
    await Promise.allSettled([...sessions.keys()].map((id) => closeSession(id)));
  },
});

/**
 * Interrupts the running turn; if Codex does not end it in time, stops the process, which ends
 * the turn (its waiter fails) so that `run` is answered well within Brain's cancel grace.
 */
function interrupt(entry, turn) {
  if (turn.interrupting || turn.turnId === undefined) return;
  turn.interrupting = true;
  const proc = entry.process;
  proc.request("turn/interrupt", { threadId: entry.threadId, turnId: turn.turnId }).catch((error) =>
    log("agentloop-codex: turn/interrupt failed:", error.message),
  );
  withTimeout(proc.turn(turn.turnId).promise, INTERRUPT_WAIT_MS).then((done) => {
    if (done === undefined && proc.alive) {
      log("agentloop-codex: codex did not end the interrupted turn; stopping it");
      proc.stop().catch(() => {});
    }
  }, () => {});
}

process.on("exit", () => {
  for (const entry of sessions.values()) {
    try {
      entry.process.child.kill("SIGKILL");
    } catch {
      // gone already
    }
  }
});
