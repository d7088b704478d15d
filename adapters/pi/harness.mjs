#!/usr/bin/env node
// agentloop-pi: the Pi coding agent (@mariozechner/pi-coding-agent) as a Brain harness
// (brain/harness/v1, docs/PROTOCOL.md), built on ../sdk-js. How it maps Pi onto Brain is told in
// docs/ADAPTERS.md; in short:
//
// - each Brain session is one Pi AgentSession, created with Pi's own `createAgentSession` and a
//   `SessionManager` persisting under `<state_dir>/pi/`; a later activation (also in a restarted
//   worker) reopens it from there, so Pi's native state is the continuation;
// - Pi's model is a custom provider `brain` in Pi's model registry whose stream calls
//   `brain/call model` and turns the ModelResult into Pi's assistant message events; the original
//   Brain blocks (native ones included) ride along on the message and go back to Brain untouched;
// - the only tools Pi may offer are the session's admitted tools, each executing through
//   `brain/call tool`; Pi's built-in tools (read, bash, edit, write, …) are never enabled: a
//   session tool of the same name replaces the built-in definition;
// - Pi's automatic retries are off (Brain never retries an effect); compaction is Pi's own;
// - the transcript goes to Brain with `transcript.set` before `run` is answered;
// - `cancel`, or a fatal callback error, aborts Pi's running prompt.
//
// `run` answers {"result": {"text": <Pi's last assistant text>, "model_calls": <n>,
// "stop_reason": <Pi's>}}; a failed model call fails the run with its code (e.g. model_failed).
//
// stdout carries protocol lines only: the SDK keeps a private handle on it and sends everything
// else (console.log, process.stdout.write) to stderr.

import { mkdirSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";
import { CallError, HarnessError, PROTOCOL, guardStdout, log, serve } from "@brain/harness-sdk";

// Take stdout before anything (Pi included) can print on it.
guardStdout();

const ADAPTER_VERSION = "0.1.0";
/** The format of the native state under `state_dir` (Pi's session files in `pi/`). */
const STATE_VERSION = "1";
const PI_PACKAGE = "@mariozechner/pi-coding-agent";
/**
 * The name of a session's provider in its Pi model registry, which is also its `api` in Pi's
 * (process-wide) API registry: one per Brain session, so that every Pi model call — the agent
 * loop's and compaction's alike — reaches the activation of its own session, and so that closing
 * the session can unregister it.
 */
const providerName = (sessionId) => `brain/${sessionId}`;
/** Keys the session's (and the registration's) configuration may use. */
const CONFIGURATION_KEYS = ["compaction"];
const COMPACTION_KEYS = ["enabled", "reserve_tokens", "keep_recent_tokens"];

function piVersion() {
  try {
    // Resolved as Node resolves it, so that an installed package (dependencies hoisted) finds it.
    const path = createRequire(import.meta.url).resolve(`${PI_PACKAGE}/package.json`);
    return JSON.parse(readFileSync(path, "utf8")).version;
  } catch {
    return "unknown";
  }
}

// Pi takes seconds to import: start at once, while Brain's initialize is on its way. A worker whose
// Pi cannot load fails initialize, so `brain check` shows it.
const piLoaded = Promise.all([import(PI_PACKAGE), import("@mariozechner/pi-ai")]).then(([pi, ai]) => ({ pi, ai }));
piLoaded.catch((error) => log(`agentloop-pi: loading ${PI_PACKAGE} failed (run npm ci in adapters/pi):`, error));

/** Brain session id -> its open Pi session: { agent, provider, activation } */
const sessions = new Map();

serve({
  async initialize() {
    try {
      await piLoaded;
    } catch (error) {
      throw new HarnessError(
        "harness_error",
        `agentloop-pi cannot load ${PI_PACKAGE} (run npm ci in adapters/pi): ${error.message}`,
      );
    }
    return {
      protocol: PROTOCOL,
      identity: { name: "agentloop-pi", version: `${ADAPTER_VERSION}+pi.${piVersion()}` },
      state_version: STATE_VERSION,
      capabilities: { media: true, transcript_import: true, fixed_tool_catalogue: true },
      configuration_keys: CONFIGURATION_KEYS,
      required_model_metadata: ["context_window", "max_output_tokens"],
    };
  },

  async run(ctx) {
    const { pi, ai } = await piLoaded;
    const settings = compactionSettings(ctx.input.configuration ?? {});
    const { text, images } = promptOf(ctx.input);
    // An event-only activation with no events: nothing for Pi to do.
    if (text === "" && images.length === 0) return undefined;
    if (ctx.signal.aborted) throw ctx.signal.reason;
    const entry = await openSession(ctx, pi, ai, settings);
    entry.activation = { ctx, modelCalls: 0, lastCallError: undefined };
    try {
      if (ctx.signal.aborted) throw ctx.signal.reason;
      try {
        await entry.agent.prompt(text, { images, expandPromptTemplates: false, source: "rpc" });
      } catch (error) {
        if (ctx.signal.aborted) throw ctx.signal.reason;
        throw new HarnessError("harness_error", `pi: ${error.message ?? error}`);
      }
      await settled(entry.agent);
      // Save the transcript before answering, also after cancel (transcript.set still works then).
      await saveTranscript(ctx, entry, pi);
      if (ctx.signal.aborted) throw ctx.signal.reason;
      const last = lastAssistant(entry.agent.messages);
      if (last && (last.stopReason === "error" || last.stopReason === "aborted")) {
        const cause = entry.activation.lastCallError;
        throw new HarnessError(cause?.code ?? "harness_error", cause?.message ?? last.errorMessage ?? "pi: the model call failed");
      }
      return {
        text: last ? assistantText(last) : "",
        model_calls: entry.activation.modelCalls,
        stop_reason: last?.stopReason,
      };
    } finally {
      entry.activation = undefined;
    }
  },

  // The SDK aborted ctx.signal (cancel, or a fatal callback error): abort Pi's running prompt.
  cancel(ctx) {
    const entry = sessions.get(ctx.sessionId);
    if (entry && entry.activation?.ctx === ctx) {
      entry.agent.abort().catch((error) => log("agentloop-pi: abort failed:", error));
    }
  },

  async close({ session_id }) {
    const entry = sessions.get(session_id);
    if (!entry) return;
    sessions.delete(session_id);
    try {
      entry.agent.dispose();
      const { ai } = await piLoaded;
      ai.unregisterApiProviders(`provider:${entry.provider}`);
    } catch (error) {
      log("agentloop-pi: releasing the session failed:", error);
    }
  },
});

/** Pi's compaction settings from the `compaction` configuration key, refusing what is wrong. */
function compactionSettings(configuration) {
  const compaction = configuration.compaction;
  if (compaction === undefined || compaction === null) return {};
  if (typeof compaction === "boolean") return { enabled: compaction };
  if (typeof compaction !== "object" || Array.isArray(compaction)) {
    throw new HarnessError(
      "invalid_configuration",
      `configuration.compaction must be a boolean or an object, got ${JSON.stringify(compaction)}`,
    );
  }
  const settings = {};
  for (const [key, value] of Object.entries(compaction)) {
    if (!COMPACTION_KEYS.includes(key)) {
      throw new HarnessError(
        "invalid_configuration",
        `configuration.compaction: unknown key ${JSON.stringify(key)} (accepted: ${COMPACTION_KEYS.join(", ")})`,
      );
    }
    const ok = key === "enabled" ? typeof value === "boolean" : Number.isInteger(value) && value > 0;
    if (!ok) {
      throw new HarnessError(
        "invalid_configuration",
        `configuration.compaction.${key}: expected ${key === "enabled" ? "a boolean" : "a positive integer"}, got ${JSON.stringify(value)}`,
      );
    }
    settings[{ enabled: "enabled", reserve_tokens: "reserveTokens", keep_recent_tokens: "keepRecentTokens" }[key]] =
      value;
  }
  return settings;
}

/** The session's open Pi session, or a new one reopened from (or created in) `<state_dir>/pi/`. */
async function openSession(ctx, pi, ai, compaction) {
  const open = sessions.get(ctx.sessionId);
  if (open) return open;
  const { stateDir, model, input } = ctx;
  if (typeof stateDir !== "string" || stateDir === "") {
    throw new HarnessError("invalid_input", "run: state_dir must be a non-empty string");
  }
  if (!Number.isInteger(model.context_window) || !Number.isInteger(model.max_output_tokens)) {
    throw new HarnessError(
      "missing_model_metadata",
      "model: context_window and max_output_tokens are required (integers)",
    );
  }
  const piDir = join(stateDir, "pi");
  mkdirSync(piDir, { recursive: true, mode: 0o700 });

  const entry = { agent: undefined, provider: providerName(ctx.sessionId), activation: undefined };
  const authStorage = pi.AuthStorage.inMemory();
  const modelRegistry = pi.ModelRegistry.inMemory(authStorage);
  modelRegistry.registerProvider(entry.provider, {
    name: "Brain",
    api: entry.provider,
    baseUrl: "brain:",
    // A placeholder: Pi wants a key for a provider; Brain holds the real ones.
    apiKey: "brain-holds-the-credentials",
    streamSimple: (piModel, context, options) => streamThroughBrain(ai, entry, piModel, context, options),
    models: [
      {
        id: model.name || "default",
        name: `${model.provider}:${model.name}`,
        reasoning: false,
        input: ["text", "image"],
        cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
        contextWindow: model.context_window,
        maxTokens: model.max_output_tokens,
      },
    ],
  });
  const piModel = modelRegistry.find(entry.provider, model.name || "default");

  const sessionManager = pi.SessionManager.continueRecent(stateDir, join(piDir, "sessions"));
  const restored = sessionManager.buildSessionContext().messages.length > 0;
  if (!restored && Array.isArray(input.transcript) && input.transcript.length > 0) {
    // A session created with a transcript (or whose native state is gone): Pi starts from it.
    for (const message of fromBrainTranscript(input.transcript)) sessionManager.appendMessage(message);
  }

  const settingsManager = pi.SettingsManager.inMemory({
    // Brain never retries an effect, and neither may Pi.
    retry: { enabled: false, maxRetries: 0, provider: { maxRetries: 0 } },
    compaction,
  });
  const system = typeof input.system === "string" && input.system !== "" ? input.system : undefined;
  const resourceLoader = {
    getExtensions: () => ({ extensions: [], errors: [], runtime: pi.createExtensionRuntime() }),
    getSkills: () => ({ skills: [], diagnostics: [] }),
    getPrompts: () => ({ prompts: [], diagnostics: [] }),
    getThemes: () => ({ themes: [], diagnostics: [] }),
    getAgentsFiles: () => ({ agentsFiles: [] }),
    getSystemPrompt: () => system,
    getAppendSystemPrompt: () => [],
    extendResources: () => {},
    reload: async () => {},
  };

  const tools = (input.tools ?? []).map((tool) => brainTool(tool, entry));
  const { session: agent } = await pi.createAgentSession({
    cwd: stateDir,
    agentDir: piDir,
    model: piModel,
    thinkingLevel: "off",
    authStorage,
    modelRegistry,
    resourceLoader,
    settingsManager,
    sessionManager,
    // Only the session's tools, as custom tools executing through Brain: the allowlist keeps every
    // built-in tool out, and a session tool named like a built-in replaces its definition.
    tools: tools.map((tool) => tool.name),
    customTools: tools,
  });
  agent.setAutoRetryEnabled(false);
  entry.agent = agent;
  sessions.set(ctx.sessionId, entry);
  log(`agentloop-pi: session ${ctx.sessionId} ${restored ? "reopened" : "created"} (pi session ${agent.sessionId})`);
  return entry;
}

/**
 * A session tool as a Pi tool definition whose execution is `brain/call tool` in the activation
 * running `entry`'s session. A ToolResult with `is_error` (or an outcome other than `ok`) and a
 * callback error both reach the model as Pi's error result; a fatal error also aborts the prompt
 * (through ctx.signal).
 */
function brainTool(tool, entry) {
  return {
    name: tool.name,
    label: tool.name,
    description: tool.description ?? "",
    parameters: tool.input_schema ?? { type: "object" },
    async execute(_toolCallId, params) {
      const activation = entry.activation;
      if (!activation) throw new Error(`tool ${tool.name}: no running activation`);
      let result;
      try {
        result = await activation.ctx.callTool(tool.name, params ?? {});
      } catch (error) {
        throw new Error(`tool ${tool.name} failed (${error.code ?? "error"}): ${error.message}`);
      }
      const content = blocksToPi(result?.content ?? []);
      if (result?.is_error === true || (result?.outcome && result.outcome !== "ok")) {
        const text = content.filter((part) => part.type === "text").map((part) => part.text).join("\n");
        throw new Error(text || `tool ${tool.name} ended ${result?.outcome}`);
      }
      return { content, details: { outcome: result?.outcome ?? "ok" } };
    },
  };
}

/** The text and images of a `run`'s user input and pending events, as one Pi prompt. */
function promptOf(input) {
  const texts = [];
  const images = [];
  for (const block of input.input?.content ?? []) {
    if (block.type === "text") texts.push(block.text);
    else if (block.type === "image" || block.type === "file") images.push(mediaToPi(block));
  }
  const events = input.events ?? [];
  if (events.length > 0) {
    texts.push(events.map((e) => `event ${e.type}: ${JSON.stringify(e.data ?? null)}`).join("\n"));
  }
  return { text: texts.join("\n"), images };
}

/**
 * A Brain media block in Pi's message model. Pi's images carry base64 data; Brain's carry https
 * URLs, so the Pi block carries the Brain block along (`brain`) and goes back to Brain as it came.
 */
function mediaToPi(block) {
  if (block.type === "image") {
    return { type: "image", data: "", mimeType: mimeOf(block.url), brain: block };
  }
  return { type: "image", data: "", mimeType: block.media_type ?? "application/octet-stream", brain: block };
}

function mimeOf(url) {
  const path = String(url).split(/[?#]/)[0].toLowerCase();
  for (const [ext, mime] of [
    [".png", "image/png"],
    [".jpg", "image/jpeg"],
    [".jpeg", "image/jpeg"],
    [".gif", "image/gif"],
    [".webp", "image/webp"],
  ]) {
    if (path.endsWith(ext)) return mime;
  }
  return "image/*";
}

/** Brain transcript messages as Pi messages (for a session created with a transcript). */
function fromBrainTranscript(messages) {
  const out = [];
  const now = Date.now();
  for (const message of messages) {
    const content = message.content ?? [];
    if (message.role === "assistant") {
      out.push({
        role: "assistant",
        content: assistantContentToPi(content),
        api: "brain",
        provider: "brain",
        model: "imported",
        usage: zeroUsage(),
        stopReason: content.some((b) => b.type === "tool_use") ? "toolUse" : "stop",
        timestamp: now,
        brain: { content },
      });
      continue;
    }
    // user and developer messages: tool results become Pi tool result messages, the rest a user message.
    const rest = [];
    for (const block of content) {
      if (block.type === "tool_result") {
        out.push({
          role: "toolResult",
          toolCallId: block.tool_use_id,
          toolName: toolNameOf(messages, block.tool_use_id),
          content: blocksToPi(block.content ?? []),
          isError: block.is_error === true,
          timestamp: now,
        });
      } else {
        rest.push(block);
      }
    }
    if (rest.length > 0) out.push({ role: "user", content: blocksToPi(rest), timestamp: now });
  }
  return out;
}

function toolNameOf(messages, id) {
  for (const message of messages) {
    for (const block of message.content ?? []) {
      if (block.type === "tool_use" && block.id === id) return block.name;
    }
  }
  return "unknown";
}

/** Brain blocks as Pi user/tool-result content (text and images; anything else rides along). */
function blocksToPi(blocks) {
  return blocks.map((block) => {
    if (block.type === "text") return { type: "text", text: block.text };
    if (block.type === "image" || block.type === "file") return mediaToPi(block);
    return { type: "text", text: `[${block.type}]`, brain: block };
  });
}

function assistantContentToPi(blocks) {
  const content = [];
  for (const block of blocks) {
    if (block.type === "text") content.push({ type: "text", text: block.text });
    else if (block.type === "tool_use") {
      content.push({ type: "toolCall", id: block.id, name: block.name, arguments: block.input ?? {} });
    }
  }
  return content;
}

/** Pi content (user or tool result) as Brain blocks. */
function blocksFromPi(content) {
  if (typeof content === "string") return [{ type: "text", text: content }];
  const blocks = [];
  for (const part of content ?? []) {
    if (part.brain) blocks.push(part.brain);
    else if (part.type === "text") blocks.push({ type: "text", text: part.text });
    else if (part.type === "image") {
      blocks.push({ type: "text", text: "[an image Brain cannot pass on: only https URLs reach the model]" });
    }
  }
  return blocks;
}

/**
 * Pi's LLM messages (after `convertToLlm`) as Brain messages. Assistant messages that failed or
 * were aborted are left out, like Pi's own providers do, and so are the results of their tool
 * calls; consecutive tool results become one user message of `tool_result` blocks.
 */
function toBrainMessages(llmMessages) {
  const out = [];
  const dropped = new Set();
  for (const message of llmMessages) {
    if (message.role === "assistant") {
      if (message.stopReason === "error" || message.stopReason === "aborted") {
        for (const part of message.content ?? []) if (part.type === "toolCall") dropped.add(part.id);
        continue;
      }
      const content = message.brain?.content ?? assistantContentFromPi(message.content);
      out.push({ role: "assistant", content });
    } else if (message.role === "toolResult") {
      if (dropped.has(message.toolCallId)) continue;
      const block = {
        type: "tool_result",
        tool_use_id: message.toolCallId,
        content: blocksFromPi(message.content),
        is_error: message.isError === true,
      };
      const previous = out[out.length - 1];
      if (previous && previous.role === "user" && previous.content.every((b) => b.type === "tool_result")) {
        previous.content.push(block);
      } else {
        out.push({ role: "user", content: [block] });
      }
    } else if (message.role === "user") {
      out.push({ role: "user", content: blocksFromPi(message.content) });
    }
  }
  return out;
}

function assistantContentFromPi(content) {
  const blocks = [];
  for (const part of content ?? []) {
    if (part.type === "text") blocks.push({ type: "text", text: part.text });
    else if (part.type === "toolCall") {
      blocks.push({ type: "tool_use", id: part.id, name: part.name, input: part.arguments ?? {} });
    }
  }
  return blocks;
}

function zeroUsage() {
  return {
    input: 0,
    output: 0,
    cacheRead: 0,
    cacheWrite: 0,
    totalTokens: 0,
    cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 },
  };
}

const STOP_REASONS = {
  end_turn: "stop",
  tool_use: "toolUse",
  max_tokens: "length",
  stop_sequence: "stop",
  refusal: "stop",
  unknown: "stop",
};

/**
 * The `brain` provider's stream: one `brain/call model` per Pi model call, its ModelResult
 * replayed as Pi's assistant message events. Nothing is retried; a failed call ends the stream
 * with an error (or `aborted` once the activation was cancelled).
 */
function streamThroughBrain(ai, entry, piModel, context, options) {
  const stream = ai.createAssistantMessageEventStream();
  const output = {
    role: "assistant",
    content: [],
    api: piModel.api,
    provider: piModel.provider,
    model: piModel.id,
    usage: zeroUsage(),
    stopReason: "stop",
    timestamp: Date.now(),
  };
  const activation = entry.activation;
  const signal = options?.signal;
  (async () => {
    try {
      if (!activation) throw new Error("a model call outside of an activation: Brain would refuse it");
      const request = {
        messages: toBrainMessages(context.messages),
        tools: (context.tools ?? []).map((tool) => ({
          name: tool.name,
          description: tool.description ?? "",
          input_schema: tool.parameters ?? { type: "object" },
        })),
      };
      if (context.systemPrompt) request.system = context.systemPrompt;
      if (Number.isInteger(options?.maxTokens)) request.max_output_tokens = options.maxTokens;
      activation.modelCalls += 1;
      const call = activation.ctx.callModel(request);
      // On abort, end the stream at once; the SDK still waits for the callback before answering run.
      const aborted = new Promise((_, reject) => {
        if (signal?.aborted) reject(new Error("aborted"));
        signal?.addEventListener("abort", () => reject(new Error("aborted")), { once: true });
      });
      call.catch(() => {});
      const result = await Promise.race([call, aborted]);
      replay(stream, output, result);
    } catch (error) {
      if (error instanceof CallError && activation) activation.lastCallError = error;
      output.stopReason = signal?.aborted || activation?.ctx.signal.aborted ? "aborted" : "error";
      output.errorMessage = error?.message ?? String(error);
      stream.push({ type: "error", reason: output.stopReason, error: output });
      stream.end();
    }
  })();
  return stream;
}

/** Pushes a ModelResult as Pi events onto `stream`, keeping Brain's blocks on the message. */
function replay(stream, output, result) {
  const message = result?.message ?? { content: [] };
  const blocks = Array.isArray(message.content) ? message.content : [];
  output.brain = { content: blocks };
  const usage = result?.usage ?? {};
  output.usage.input = usage.input_tokens ?? 0;
  output.usage.output = usage.output_tokens ?? 0;
  output.usage.cacheRead = usage.cache_read_input_tokens ?? 0;
  output.usage.cacheWrite = usage.cache_creation_input_tokens ?? 0;
  output.usage.totalTokens = output.usage.input + output.usage.output + output.usage.cacheRead + output.usage.cacheWrite;
  if (typeof result?.model === "string") output.responseModel = result.model;
  stream.push({ type: "start", partial: output });
  for (const block of blocks) {
    if (block.type === "text") {
      output.content.push({ type: "text", text: "" });
      const index = output.content.length - 1;
      stream.push({ type: "text_start", contentIndex: index, partial: output });
      output.content[index].text = block.text;
      stream.push({ type: "text_delta", contentIndex: index, delta: block.text, partial: output });
      stream.push({ type: "text_end", contentIndex: index, content: block.text, partial: output });
    } else if (block.type === "tool_use") {
      const toolCall = { type: "toolCall", id: block.id, name: block.name, arguments: block.input ?? {} };
      output.content.push(toolCall);
      const index = output.content.length - 1;
      stream.push({ type: "toolcall_start", contentIndex: index, partial: output });
      stream.push({ type: "toolcall_delta", contentIndex: index, delta: JSON.stringify(toolCall.arguments), partial: output });
      stream.push({ type: "toolcall_end", contentIndex: index, toolCall, partial: output });
    }
    // native (and any other) blocks stay in output.brain only: Pi never sees or alters them.
  }
  const hasToolCalls = output.content.some((part) => part.type === "toolCall");
  output.stopReason = hasToolCalls ? "toolUse" : (STOP_REASONS[result?.stop_reason] ?? "stop");
  stream.push({ type: "done", reason: output.stopReason, message: output });
  stream.end();
}

/**
 * Waits until Pi has processed the events of the finished prompt. Pi handles `agent_end` (where
 * its threshold compaction runs) on an internal queue that `prompt()` does not await; waiting here
 * keeps that compaction, and its model call through Brain, inside the activation. The queue is
 * not public API: without it (another Pi version) this waits for nothing.
 */
async function settled(agent) {
  const queue = agent._agentEventQueue;
  if (queue && typeof queue.then === "function") await queue.then(() => {}, () => {});
}

/** `transcript.set` with the Pi session's messages in Brain's shape. */
async function saveTranscript(ctx, entry, pi) {
  const messages = toBrainMessages(pi.convertToLlm(entry.agent.messages));
  await ctx.transcript.set(messages);
}

function lastAssistant(messages) {
  for (let i = messages.length - 1; i >= 0; i--) {
    if (messages[i].role === "assistant") return messages[i];
  }
  return undefined;
}

function assistantText(message) {
  return (message.content ?? [])
    .filter((part) => part.type === "text")
    .map((part) => part.text)
    .join("");
}

