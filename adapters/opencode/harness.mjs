#!/usr/bin/env node
// agentloop-opencode: OpenCode (opencode-ai, its embedded server, @opencode-ai/sdk) as a Brain
// harness (brain/harness/v1, docs/PROTOCOL.md), built on @brain/harness-sdk (../sdk-js). docs/ADAPTERS.md tells how it
// maps OpenCode onto Brain; in short:
//
// - each open Brain session has its own `opencode serve` process, started through the SDK's
//   `createOpencodeServer` on 127.0.0.1 with HOME, TMPDIR and the XDG data/config/cache/state
//   directories inside `<state_dir>/opencode/`; it is started at the session's first activation in
//   this worker, kept while the session is open, and stopped at `close` and at `shutdown`;
// - OpenCode's working directory `<state_dir>/opencode/workspace` is an empty git repository of
//   its own, so that OpenCode never takes an enclosing checkout for its project;
// - the OpenCode session id is kept in `<state_dir>/opencode/session.json`: a later activation
//   (also in a restarted worker or Brain) continues that session from OpenCode's own storage; the
//   session's tool declarations are kept with it, and another catalogue fails unsupported_input;
// - OpenCode's model is a custom provider `brain` (OpenCode's bundled `@ai-sdk/openai-compatible`)
//   whose base URL is this process's loopback gateway (random port, per-process token): each
//   Chat Completions request becomes one `brain/call model` of the session's running activation,
//   answered back as Chat Completions (streamed when asked). Brain's blocks of each answer are
//   kept in `<state_dir>/opencode/brain-messages.json` and replace OpenCode's copy when the
//   message comes back, so `native` blocks go back to Brain untouched;
// - the session's tools are served to OpenCode by the same gateway as a (Streamable HTTP) MCP
//   server `brain`; every call is `brain/call tool`. OpenCode's built-in tools are all denied;
// - retries: OpenCode's retry loop only retries errors it deems retryable (HTTP 408/409/429/5xx,
//   "overloaded", …); the gateway answers a failed Brain call with a plain HTTP 400, so a failed
//   model call fails the turn after exactly one call;
// - `cancel` (or a fatal callback error) calls OpenCode's session abort API, and the gateway makes
//   no further Brain call for the activation;
// - the transcript goes to Brain with `transcript.set` before `run` is answered.
//
// `run` answers {"result": {"text": <the last assistant text>, "model_calls": <n>}}.
// stdout carries protocol lines only (the SDK guards it); OpenCode's own output goes to stderr.

import { randomBytes, createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { createRequire } from "node:module";
import { CallError, HarnessError, PROTOCOL, guardStdout, log, serve } from "@brain/harness-sdk";

guardStdout();

const ADAPTER_VERSION = "0.1.0";
/** The format of `<state_dir>/opencode/` (OpenCode's storage, session.json, brain-messages.json). */
const STATE_VERSION = "1";
const CONFIGURATION_KEYS = [];
const HERE = dirname(fileURLToPath(import.meta.url));
const PROVIDER = "brain";
const MCP_SERVER = "brain";
/** Per-process secret every gateway request must carry. */
const TOKEN = randomBytes(24).toString("hex");

const require = createRequire(import.meta.url);

/** The root directory of an installed package, resolved from `from` (a directory) or undefined. */
function packageRoot(name, from = HERE) {
  try {
    return dirname(createRequire(join(from, "package.json")).resolve(`${name}/package.json`));
  } catch {
    return undefined;
  }
}

function packageVersion(name) {
  try {
    return JSON.parse(readFileSync(require.resolve(`${name}/package.json`), "utf8")).version;
  } catch {
    return "unknown";
  }
}

/**
 * The pinned OpenCode binary: the platform package's (`opencode-linux-x64`, or its `-baseline`
 * build for CPUs without AVX2), a direct optional dependency of the adapter. `opencode-ai` is not
 * used: its `bin/opencode` is a placeholder its postinstall replaces, and its optional
 * dependencies name every platform's package, which a lockfile must then all hold.
 */
function opencodePackage() {
  const arch = process.arch === "arm64" ? "arm64" : "x64";
  for (const name of [`opencode-${process.platform}-${arch}`, `opencode-${process.platform}-${arch}-baseline`]) {
    const root = packageRoot(name);
    if (root && existsSync(join(root, "bin", "opencode"))) return { name, bin: join(root, "bin") };
  }
  return undefined;
}

function opencodeBinDir() {
  return opencodePackage()?.bin;
}

/** OpenCode's version: its platform package's. */
function opencodeVersion() {
  const found = opencodePackage();
  return found ? packageVersion(found.name) : "unknown";
}

const sdkLoaded = import("@opencode-ai/sdk");
sdkLoaded.catch((error) => log("agentloop-opencode: loading @opencode-ai/sdk failed (run npm ci in adapters/opencode):", error));

/** Brain session id -> its open OpenCode session (see openSession). */
const sessions = new Map();
/** Gateway key (a random path segment) -> the same entries. */
const byKey = new Map();

// ---------------------------------------------------------------------------------------------
// The loopback gateway: Chat Completions for the provider, MCP for the tools.

let gatewayPort;
const gatewayReady = new Promise((resolve, reject) => {
  const server = createServer((request, response) => {
    handle(request, response).catch((error) => {
      log("agentloop-opencode: gateway:", error);
      if (!response.headersSent) reply(response, 500, { error: { message: "gateway error" } });
      else response.end();
    });
  });
  server.keepAliveTimeout = 60_000;
  server.requestTimeout = 0;
  server.headersTimeout = 60_000;
  server.on("error", reject);
  server.listen(0, "127.0.0.1", () => {
    gatewayPort = server.address().port;
    server.unref();
    resolve();
  });
});

function reply(response, status, body, headers = {}) {
  const text = body === undefined ? "" : JSON.stringify(body);
  response.writeHead(status, { "content-type": "application/json", ...headers });
  response.end(text);
}

async function readBody(request) {
  const chunks = [];
  for await (const chunk of request) chunks.push(chunk);
  const text = Buffer.concat(chunks).toString("utf8");
  return text === "" ? undefined : JSON.parse(text);
}

async function handle(request, response) {
  const url = new URL(request.url, "http://127.0.0.1");
  const match = url.pathname.match(/^\/s\/([0-9a-f]+)\/(v1\/chat\/completions|mcp)$/);
  const auth = request.headers.authorization ?? "";
  if (!match || auth !== `Bearer ${TOKEN}`) return reply(response, 404, { error: { message: "not found" } });
  const entry = byKey.get(match[1]);
  if (!entry) return reply(response, 404, { error: { message: "no such session" } });
  if (match[2] === "mcp") return mcp(entry, request, response);
  if (request.method !== "POST") return reply(response, 405, { error: { message: "POST only" } });
  return chatCompletions(entry, await readBody(request), response);
}

/** One OpenCode model request: one `brain/call model`, answered as Chat Completions. */
async function chatCompletions(entry, body, response) {
  const activation = entry.activation;
  if (!activation) {
    return reply(response, 400, { error: { message: "brain: a model call outside of an activation", type: "invalid_request_error" } });
  }
  if (activation.ctx.signal.aborted) {
    // Cancelled, or a callback failed fatally: no further callback; OpenCode's abort is under way.
    return reply(response, 400, { error: { message: "brain: the activation was stopped", type: "invalid_request_error" } });
  }
  let request;
  try {
    request = toBrainRequest(entry, body);
  } catch (error) {
    log("agentloop-opencode: refusing OpenCode's model request:", error.message);
    activation.refused = error.message;
    return reply(response, 400, { error: { message: `brain: ${error.message}`, type: "invalid_request_error" } });
  }
  activation.modelCalls += 1;
  let result;
  try {
    result = await activation.ctx.callModel(request);
  } catch (error) {
    if (error instanceof CallError) activation.lastCallError = error;
    // A plain 400 with a neutral message: OpenCode and the AI SDK never retry it.
    return reply(response, 400, { error: { message: "brain: the model call failed", type: "invalid_request_error" } });
  }
  const blocks = Array.isArray(result?.message?.content) ? result.message.content : [];
  const message = toChatMessage(entry, blocks);
  rememberBlocks(entry, message, blocks);
  const finish = message.tool_calls ? "tool_calls" : result?.stop_reason === "max_tokens" ? "length" : "stop";
  const usage = toChatUsage(result?.usage);
  const id = `chatcmpl-${randomBytes(8).toString("hex")}`;
  const created = Math.floor(Date.now() / 1000);
  const model = body?.model ?? "brain";
  if (body?.stream !== true) {
    const answer = { id, object: "chat.completion", created, model,
                     choices: [{ index: 0, message, finish_reason: finish }] };
    if (usage) answer.usage = usage;
    return reply(response, 200, answer);
  }
  response.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  const send = (choices, extra = {}) =>
    response.write(`data: ${JSON.stringify({ id, object: "chat.completion.chunk", created, model, choices, ...extra })}\n\n`);
  send([{ index: 0, delta: { role: "assistant", content: message.content ?? "" }, finish_reason: null }]);
  (message.tool_calls ?? []).forEach((call, index) => {
    send([{ index: 0, delta: { tool_calls: [{ index, ...call }] }, finish_reason: null }]);
  });
  send([{ index: 0, delta: {}, finish_reason: finish }]);
  if (usage) send([], { usage });
  response.write("data: [DONE]\n\n");
  response.end();
}

/**
 * Brain's usage as Chat Completions usage, with only the counters Brain has: nothing is zero-filled.
 * `prompt_tokens` counts cached input too (Brain's `input_tokens` does not), so it is given only
 * when `input_tokens` is; `total_tokens` only when both sides are known. Undefined when Brain
 * reported nothing, and then the answer carries no `usage` at all.
 */
function toChatUsage(usage) {
  if (!usage) return undefined;
  const known = (n) => Number.isInteger(n);
  const answer = {};
  if (known(usage.input_tokens)) {
    answer.prompt_tokens = usage.input_tokens + (usage.cache_read_input_tokens ?? 0) + (usage.cache_creation_input_tokens ?? 0);
  }
  if (known(usage.output_tokens)) answer.completion_tokens = usage.output_tokens;
  if (known(answer.prompt_tokens) && known(answer.completion_tokens)) answer.total_tokens = answer.prompt_tokens + answer.completion_tokens;
  if (known(usage.cache_read_input_tokens)) answer.prompt_tokens_details = { cached_tokens: usage.cache_read_input_tokens };
  if (known(usage.reasoning_tokens)) answer.completion_tokens_details = { reasoning_tokens: usage.reasoning_tokens };
  return Object.keys(answer).length > 0 ? answer : undefined;
}

/** Brain blocks as one Chat Completions assistant message (tool names as OpenCode knows them). */
function toChatMessage(entry, blocks) {
  const text = blocks.filter((b) => b.type === "text").map((b) => b.text).join("");
  const calls = blocks
    .filter((b) => b.type === "tool_use")
    .map((b) => ({ id: b.id, type: "function",
                   function: { name: entry.toolNames.toOpencode.get(b.name) ?? b.name, arguments: JSON.stringify(b.input ?? {}) } }));
  const message = { role: "assistant", content: text };
  if (calls.length > 0) message.tool_calls = calls;
  return message;
}

/** What identifies an assistant message OpenCode sends back: its text and its tool calls. */
function fingerprint(text, calls) {
  const canonical = JSON.stringify({
    text: (text ?? "").trim(),
    calls: (calls ?? []).map((c) => [c.id, c.function?.name, canonicalJson(parseArguments(c.function?.arguments))]),
  });
  return createHash("sha256").update(canonical).digest("hex");
}

function parseArguments(text) {
  if (typeof text !== "string" || text === "") return {};
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function canonicalJson(value) {
  if (Array.isArray(value)) return value.map(canonicalJson);
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.keys(value).sort().map((k) => [k, canonicalJson(value[k])]));
  }
  return value;
}

/** Keeps the Brain blocks of an answer under its fingerprint, durably, before OpenCode sees it. */
function rememberBlocks(entry, message, blocks) {
  entry.blocks[fingerprint(message.content, message.tool_calls)] = blocks;
  const file = join(entry.dir, "brain-messages.json");
  writeFileSync(`${file}.tmp`, JSON.stringify(entry.blocks));
  renameSync(`${file}.tmp`, file);
}

/** An OpenCode Chat Completions request as a Brain ModelRequest. */
function toBrainRequest(entry, body) {
  if (!body || !Array.isArray(body.messages)) throw new Error("the request has no messages");
  const system = [];
  const messages = [];
  const pushUser = (block) => {
    const last = messages[messages.length - 1];
    const toolResults = (m) => m.content.every((b) => b.type === "tool_result");
    if (last && last.role === "user" && block.type === "tool_result" && toolResults(last)) last.content.push(block);
    else messages.push({ role: "user", content: [block] });
  };
  for (const message of body.messages) {
    const text = contentText(message.content);
    if (message.role === "system" || message.role === "developer") {
      if (text !== "") system.push(text);
    } else if (message.role === "user") {
      messages.push({ role: "user", content: [{ type: "text", text }] });
    } else if (message.role === "assistant") {
      const kept = entry.blocks[fingerprint(text, message.tool_calls)];
      if (kept) {
        messages.push({ role: "assistant", content: kept });
        continue;
      }
      const content = [];
      if (text !== "") content.push({ type: "text", text });
      for (const call of message.tool_calls ?? []) {
        content.push({ type: "tool_use", id: call.id, name: brainToolName(entry, call.function?.name),
                       input: parseArguments(call.function?.arguments) });
      }
      messages.push({ role: "assistant", content });
    } else if (message.role === "tool") {
      pushUser({ type: "tool_result", tool_use_id: message.tool_call_id,
                 content: [{ type: "text", text }], is_error: false });
    }
  }
  const tools = [];
  for (const tool of body.tools ?? []) {
    const name = tool.function?.name;
    const brain = entry.toolNames.toBrain.get(name);
    // Only the session's tools, served by the adapter's MCP server, may reach the model: anything
    // else OpenCode offers (a built-in that was not switched off) fails the call loudly.
    if (brain === undefined) throw new Error(`OpenCode offered the tool ${JSON.stringify(name)}, which the session did not admit`);
    const declared = entry.tools.find((t) => t.name === brain);
    tools.push({ name: brain, description: declared.description ?? "", input_schema: declared.input_schema ?? { type: "object" } });
  }
  const request = { messages };
  if (system.length > 0) request.system = system.join("\n\n");
  // Always explicit: an absent `tools` would mean the session's tools to Brain, and OpenCode's
  // requests without tools (its compaction summary) must offer none.
  request.tools = tools;
  const max = body.max_completion_tokens ?? body.max_tokens;
  if (Number.isInteger(max)) request.max_output_tokens = max;
  return request;
}

function brainToolName(entry, name) {
  return entry.toolNames.toBrain.get(name) ?? name;
}

function contentText(content) {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return "";
  return content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
}

/**
 * The session's tools as a Streamable HTTP MCP server (JSON answers, no SSE): `tools/list`
 * answers the session's declarations, `tools/call` is `brain/call tool` in the running
 * activation. The request stays open until Brain answers, and OpenCode's abort cancels it.
 */
async function mcp(entry, request, response) {
  if (request.method === "DELETE") return reply(response, 200, {});
  if (request.method !== "POST") return reply(response, 405, undefined, { allow: "POST" });
  const message = await readBody(request);
  if (Array.isArray(message)) return reply(response, 400, { error: { message: "batches are not supported" } });
  if (!message || message.id === undefined || message.id === null) {
    response.writeHead(202);
    return response.end();
  }
  const answer = (result) => reply(response, 200, { jsonrpc: "2.0", id: message.id, result }, { "mcp-session-id": entry.key });
  const fail = (code, text) => reply(response, 200, { jsonrpc: "2.0", id: message.id, error: { code, message: text } });
  switch (message.method) {
    case "initialize":
      return answer({
        protocolVersion: message.params?.protocolVersion ?? "2025-06-18",
        capabilities: { tools: { listChanged: false } },
        serverInfo: { name: "brain", version: ADAPTER_VERSION },
      });
    case "ping":
      return answer({});
    case "tools/list":
      return answer({
        tools: entry.tools.map((tool) => ({
          name: tool.name,
          description: tool.description ?? "",
          inputSchema: tool.input_schema ?? { type: "object" },
        })),
      });
    case "tools/call": {
      const name = message.params?.name;
      const activation = entry.activation;
      if (!entry.tools.some((t) => t.name === name)) return fail(-32602, `unknown tool ${JSON.stringify(name)}`);
      if (!activation) return answer({ isError: true, content: [{ type: "text", text: `tool ${name}: no running activation` }] });
      let result;
      try {
        result = await activation.ctx.callTool(name, message.params?.arguments ?? {});
      } catch (error) {
        // A fatal error (or a cancel) aborted ctx.signal and the cancel handler is aborting
        // OpenCode's turn: answer only once that abort is done, so that OpenCode never acts on
        // this result with another step.
        if (activation.ctx.signal.aborted) await aborted(entry);
        return answer({ isError: true, content: [{ type: "text", text: `tool ${name} failed (${error.code ?? "error"}): ${error.message}` }] });
      }
      const content = (result?.content ?? []).map((block) =>
        block.type === "text" ? { type: "text", text: block.text } : { type: "text", text: `[${block.type} left out: only text reaches OpenCode]` });
      const isError = result?.is_error === true || (result?.outcome !== undefined && result.outcome !== "ok");
      if (content.length === 0) content.push({ type: "text", text: isError ? `tool ${name} ended ${result?.outcome}` : "" });
      return answer({ isError, content });
    }
    default:
      return fail(-32601, `method ${JSON.stringify(message.method)} not supported`);
  }
}

// ---------------------------------------------------------------------------------------------
// The harness.

serve({
  async initialize() {
    try {
      await sdkLoaded;
      await gatewayReady;
    } catch (error) {
      throw new HarnessError("harness_error", `agentloop-opencode cannot start (run npm ci in adapters/opencode): ${error.message}`);
    }
    if (!opencodeBinDir()) {
      throw new HarnessError("harness_error", "agentloop-opencode: the opencode binary is missing (run npm ci in adapters/opencode)");
    }
    return {
      protocol: PROTOCOL,
      identity: { name: "agentloop-opencode", version: `${ADAPTER_VERSION}+opencode.${opencodeVersion()}` },
      state_version: STATE_VERSION,
      capabilities: { media: false, transcript_import: false, fixed_tool_catalogue: true },
      configuration_keys: CONFIGURATION_KEYS,
      required_model_metadata: ["context_window", "max_output_tokens"],
    };
  },

  async run(ctx) {
    const text = promptOf(ctx.input);
    if (text === "") return undefined;
    if (ctx.signal.aborted) throw ctx.signal.reason;
    const entry = await openSession(ctx);
    checkCatalogue(entry, ctx.input.tools ?? []);
    entry.activation = { ctx, modelCalls: 0, lastCallError: undefined, refused: undefined, aborting: undefined };
    try {
      if (ctx.signal.aborted) throw ctx.signal.reason;
      const body = { parts: [{ type: "text", text }], model: { providerID: PROVIDER, modelID: entry.modelId }, agent: "build" };
      if (typeof ctx.input.system === "string" && ctx.input.system !== "") body.system = ctx.input.system;
      const answer = await entry.client.session.prompt({ path: { id: entry.ocSession }, body });
      await saveTranscript(ctx, entry);
      if (ctx.signal.aborted) throw ctx.signal.reason;
      if (answer.error) {
        throw new HarnessError("harness_error", `opencode: ${JSON.stringify(answer.error).slice(0, 2000)}`);
      }
      const info = answer.data?.info;
      if (info?.error) {
        const cause = entry.activation.lastCallError;
        if (cause) throw new HarnessError(cause.code ?? "model_failed", cause.message);
        if (entry.activation.refused) throw new HarnessError("harness_error", entry.activation.refused);
        throw new HarnessError("harness_error", `opencode: ${info.error.name}: ${info.error.data?.message ?? ""}`);
      }
      const parts = answer.data?.parts ?? [];
      return {
        text: parts.filter((p) => p.type === "text" && !p.synthetic).map((p) => p.text).join(""),
        model_calls: entry.activation.modelCalls,
      };
    } finally {
      entry.activation = undefined;
    }
  },

  // ctx.signal was aborted (cancel, or a fatal callback error): abort OpenCode's running turn.
  cancel(ctx) {
    const entry = sessions.get(ctx.sessionId);
    if (entry && entry.activation?.ctx === ctx && !entry.activation.aborting) {
      entry.activation.aborting = entry.client.session
        .abort({ path: { id: entry.ocSession } })
        .catch((error) => log("agentloop-opencode: abort failed:", error));
    }
  },

  close({ session_id }) {
    stopSession(session_id);
  },

  shutdown() {
    for (const id of [...sessions.keys()]) stopSession(id);
  },
});

process.on("exit", () => {
  for (const id of [...sessions.keys()]) stopSession(id);
});

/** Resolves once the running activation's OpenCode abort (if one was started) has been answered. */
async function aborted(entry) {
  // The SDK runs the cancel handler in a later microtask than the one that aborted the signal.
  await new Promise((resolve) => setImmediate(resolve));
  await entry.activation?.aborting;
}

function stopSession(sessionId) {
  const entry = sessions.get(sessionId);
  if (!entry) return;
  sessions.delete(sessionId);
  byKey.delete(entry.key);
  try {
    entry.server.close();
  } catch (error) {
    log("agentloop-opencode: stopping the OpenCode server failed:", error);
  }
}

function promptOf(input) {
  const texts = [];
  for (const block of input.input?.content ?? []) {
    if (block.type === "text") texts.push(block.text);
    else throw new HarnessError("invalid_input", `agentloop-opencode accepts text only, got a ${block.type} block`);
  }
  const events = input.events ?? [];
  if (events.length > 0) texts.push(events.map((e) => `event ${e.type}: ${JSON.stringify(e.data ?? null)}`).join("\n"));
  return texts.join("\n");
}

/** The environment and the configuration one session's `opencode serve` runs with. */
function serverSetup(entry, model) {
  const dir = entry.dir;
  const paths = {
    HOME: join(dir, "home"),
    TMPDIR: join(dir, "tmp"),
    XDG_DATA_HOME: join(dir, "data"),
    XDG_CONFIG_HOME: join(dir, "config"),
    XDG_CACHE_HOME: join(dir, "cache"),
    XDG_STATE_HOME: join(dir, "state"),
  };
  for (const path of Object.values(paths)) mkdirSync(path, { recursive: true, mode: 0o700 });
  // OpenCode runs a background `npm install @opencode-ai/plugin` (from the registry) in every
  // config directory whose node_modules is missing or whose package-lock.json lacks a dependency of
  // its package.json. That package only serves local plugins, which are off here (OPENCODE_PURE, no
  // `plugin`): mark the directory's dependencies as settled so that no install ever starts.
  const configDir = join(paths.XDG_CONFIG_HOME, "opencode");
  mkdirSync(join(configDir, "node_modules"), { recursive: true, mode: 0o700 });
  const settled = { "@opencode-ai/plugin": opencodeVersion() };
  writeFileSync(join(configDir, "package.json"), JSON.stringify({ private: true, dependencies: settled }));
  writeFileSync(join(configDir, "package-lock.json"), JSON.stringify({ lockfileVersion: 3, packages: { "": { dependencies: settled } } }));
  const env = {
    ...paths,
    PATH: `${opencodeBinDir()}:${process.env.PATH ?? "/usr/bin:/bin"}`,
    OPENCODE_DISABLE_AUTOUPDATE: "1",
    OPENCODE_DISABLE_MODELS_FETCH: "1",
    OPENCODE_DISABLE_LSP_DOWNLOAD: "1",
    OPENCODE_DISABLE_DEFAULT_PLUGINS: "1",
    OPENCODE_DISABLE_SHARE: "1",
    OPENCODE_DISABLE_CLAUDE_CODE: "1",
    OPENCODE_DISABLE_EXTERNAL_SKILLS: "1",
    OPENCODE_DISABLE_PROJECT_CONFIG: "1",
    OPENCODE_DISABLE_EMBEDDED_WEB_UI: "1",
    OPENCODE_EXPERIMENTAL_DISABLE_FILEWATCHER: "1",
    OPENCODE_PURE: "1",
    OPENCODE_AUTO_SHARE: "",
    OPENCODE_CONFIG: "",
    OPENCODE_CONFIG_DIR: "",
    OPENCODE_PERMISSION: "",
  };
  const base = `http://127.0.0.1:${gatewayPort}/s/${entry.key}`;
  const config = {
    $schema: "https://opencode.ai/config.json",
    model: `${PROVIDER}/${entry.modelId}`,
    small_model: `${PROVIDER}/${entry.modelId}`,
    enabled_providers: [PROVIDER],
    autoupdate: false,
    share: "disabled",
    snapshot: false,
    lsp: false,
    formatter: false,
    plugin: [],
    instructions: [],
    provider: {
      [PROVIDER]: {
        npm: "@ai-sdk/openai-compatible",
        name: "Brain",
        options: { baseURL: `${base}/v1`, apiKey: TOKEN, timeout: false, maxRetries: 0 },
        models: {
          [entry.modelId]: {
            name: `${model.provider}:${model.name}`,
            tool_call: true,
            attachment: false,
            reasoning: false,
            temperature: true,
            limit: { context: model.context_window, output: model.max_output_tokens },
          },
        },
      },
    },
    mcp: {
      [MCP_SERVER]: {
        type: "remote",
        url: `${base}/mcp`,
        headers: { authorization: `Bearer ${TOKEN}` },
        oauth: false,
        enabled: true,
        timeout: 86_400_000,
      },
    },
    // Every built-in tool off; only the MCP server's tools (prefixed `brain_`) on, never asking.
    tools: { "*": false, [`${MCP_SERVER}_*`]: true },
    permission: { "*": "deny", [`${MCP_SERVER}_*`]: "allow" },
    agent: { title: { disable: true } },
  };
  return { env, config };
}

/** The session's open OpenCode server and session, or a new server continuing its session. */
async function openSession(ctx) {
  const open = sessions.get(ctx.sessionId);
  if (open) return open;
  const { stateDir, model, input } = ctx;
  if (typeof stateDir !== "string" || stateDir === "") throw new HarnessError("invalid_input", "run: state_dir must be a non-empty string");
  if (!Number.isInteger(model.context_window) || !Number.isInteger(model.max_output_tokens)) {
    throw new HarnessError("missing_model_metadata", "model: context_window and max_output_tokens are required (integers)");
  }
  const { createOpencodeServer, createOpencodeClient } = await sdkLoaded;
  await gatewayReady;
  const dir = join(stateDir, "opencode");
  const workspace = join(dir, "workspace");
  mkdirSync(workspace, { recursive: true, mode: 0o700 });
  fenceWorkspace(workspace);
  const tools = input.tools ?? [];
  const toBrain = new Map();
  const toOpencode = new Map();
  for (const tool of tools) {
    // OpenCode names an MCP tool `<server>_<tool>`, both sanitised to [A-Za-z0-9_-].
    const name = `${MCP_SERVER}_${tool.name.replace(/[^a-zA-Z0-9_-]/g, "_")}`;
    toBrain.set(name, tool.name);
    toOpencode.set(tool.name, name);
  }
  const entry = {
    key: randomBytes(12).toString("hex"),
    dir,
    modelId: (model.name || "default").replace(/[^a-zA-Z0-9._-]/g, "_"),
    tools,
    toolNames: { toBrain, toOpencode },
    blocks: readJson(join(dir, "brain-messages.json")) ?? {},
    activation: undefined,
    server: undefined,
    client: undefined,
    ocSession: undefined,
    /** The tool declarations the OpenCode session was created with (kept in session.json). */
    catalogue: undefined,
  };
  const kept = readJson(join(dir, "session.json"));
  if (kept?.id) {
    // Checked before anything starts (session.json from before this check has no `tools`).
    entry.ocSession = kept.id;
    entry.catalogue = kept.tools ?? catalogue(tools);
    checkCatalogue(entry, tools);
  }
  byKey.set(entry.key, entry);
  const { env, config } = serverSetup(entry, model);
  // createOpencodeServer spawns `opencode` (found on PATH) with process.env at the moment of the
  // call: set this session's environment for that synchronous spawn only.
  const saved = {};
  for (const [name, value] of Object.entries(env)) {
    saved[name] = process.env[name];
    if (value === "") delete process.env[name];
    else process.env[name] = value;
  }
  const cwd = process.cwd();
  let starting;
  try {
    process.chdir(workspace);
    starting = createOpencodeServer({ hostname: "127.0.0.1", port: 0, timeout: 25_000, config });
  } finally {
    process.chdir(cwd);
    for (const [name, value] of Object.entries(saved)) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  }
  try {
    entry.server = await starting;
  } catch (error) {
    byKey.delete(entry.key);
    throw new HarnessError("harness_error", `opencode serve did not start: ${error.message}`.slice(0, 4000));
  }
  entry.client = createOpencodeClient({ baseUrl: entry.server.url, directory: workspace });
  sessions.set(ctx.sessionId, entry);
  try {
    if (kept?.id) {
      const found = await entry.client.session.get({ path: { id: kept.id } });
      if (!found.data) throw new HarnessError("harness_error", `OpenCode session ${kept.id} is gone from ${dir}`);
    } else {
      const created = await entry.client.session.create({ body: { title: `Brain session ${ctx.sessionId}` } });
      if (!created.data?.id) throw new HarnessError("harness_error", `opencode: creating a session failed: ${JSON.stringify(created.error)}`);
      entry.ocSession = created.data.id;
      entry.catalogue = catalogue(tools);
      writeFileSync(join(dir, "session.json"), JSON.stringify({ id: entry.ocSession, tools: entry.catalogue }));
    }
  } catch (error) {
    stopSession(ctx.sessionId);
    throw error;
  }
  log(`agentloop-opencode: session ${ctx.sessionId} on ${entry.server.url} (opencode session ${entry.ocSession})`);
  return entry;
}

/**
 * Makes OpenCode's working directory the root of an (empty) git repository of its own. OpenCode
 * takes the nearest enclosing `.git` as its project: without this, a state_dir inside a checkout
 * (a data directory under a repository) made that repository OpenCode's project, its worktree the
 * "workspace root" of the system prompt, and OpenCode wrote its project id into the repository's
 * git directory (`<common dir>/opencode`), outside state_dir. Written by hand (HEAD, config,
 * objects/, refs/ is what git needs to see a repository), so no `git` runs for it.
 */
function fenceWorkspace(workspace) {
  const git = join(workspace, ".git");
  if (existsSync(join(git, "HEAD"))) return;
  mkdirSync(join(git, "objects"), { recursive: true, mode: 0o700 });
  mkdirSync(join(git, "refs", "heads"), { recursive: true, mode: 0o700 });
  writeFileSync(join(git, "config"), "[core]\n\trepositoryformatversion = 0\n\tbare = false\n");
  writeFileSync(join(git, "HEAD"), "ref: refs/heads/main\n");
}

/** The declarations of a session's tools, as the OpenCode session keeps them (no placements). */
function catalogue(tools) {
  return tools.map((tool) => ({ name: tool.name, description: tool.description ?? "", input_schema: tool.input_schema ?? { type: "object" } }));
}

/**
 * Refuses an activation whose tools are not those the OpenCode session was created with: the
 * session's MCP server, tool names and permissions are fixed when its `opencode serve` starts, and
 * the session's history names those tools, so another catalogue fails explicitly instead of
 * running with stale tools (Brain refuses it first for a session it recorded; this also covers
 * native state older than Brain's record).
 */
function checkCatalogue(entry, tools) {
  const now = catalogue(tools);
  if (JSON.stringify(canonicalJson(now)) === JSON.stringify(canonicalJson(entry.catalogue))) return;
  throw new HarnessError(
    "unsupported_input",
    `the tool catalogue changed since OpenCode session ${entry.ocSession} was created (its tools are fixed): ` +
      `was [${entry.catalogue.map((t) => t.name).join(", ")}], now [${now.map((t) => t.name).join(", ")}]`,
  );
}

function readJson(file) {
  try {
    return JSON.parse(readFileSync(file, "utf8"));
  } catch {
    return undefined;
  }
}

/** `transcript.set` with the OpenCode session's messages in Brain's shape. */
async function saveTranscript(ctx, entry) {
  const listed = await entry.client.session.messages({ path: { id: entry.ocSession } });
  const messages = [];
  for (const { info, parts } of listed.data ?? []) {
    if (info.role === "user") {
      const text = parts.filter((p) => p.type === "text" && !p.synthetic).map((p) => p.text).join("\n");
      if (text !== "") messages.push({ role: "user", content: [{ type: "text", text }] });
      continue;
    }
    if (info.error || info.summary) continue;
    // One assistant message of OpenCode may hold several steps (model calls): text, tool calls,
    // and the tool results, which Brain's shape puts in a user message of their own.
    let content = [];
    let results = [];
    const flush = () => {
      if (content.length > 0) messages.push({ role: "assistant", content });
      if (results.length > 0) messages.push({ role: "user", content: results });
      content = [];
      results = [];
    };
    for (const part of parts) {
      if (part.type === "step-start") flush();
      else if (part.type === "text" && part.text !== "") content.push({ type: "text", text: part.text });
      else if (part.type === "tool") {
        const brainName = entry.toolNames.toBrain.get(part.tool) ?? part.tool;
        content.push({ type: "tool_use", id: part.callID, name: brainName, input: part.state?.input ?? {} });
        const failed = part.state?.status === "error";
        const output = failed ? part.state?.error : part.state?.output;
        results.push({ type: "tool_result", tool_use_id: part.callID, content: [{ type: "text", text: String(output ?? "") }], is_error: failed });
      }
    }
    flush();
  }
  await ctx.transcript.set(messages);
}
