// @brain/harness-sdk: write a brain/harness/v1 harness in JavaScript (docs/PROTOCOL.md).
//
// A harness is an object of handlers; `serve(harness)` runs the protocol loop on stdin/stdout:
//
//   import { serve, HarnessError } from "../sdk-js/index.mjs";
//   serve({
//     initialize(params) { return { protocol: PROTOCOL, identity: {...}, state_version: "1" }; },
//     async run(ctx) {                       // one activation; ctx.signal aborts on cancel
//       const { result } = await ctx.call("model", { messages: [...] });
//       return { text: "..." };              // becomes {"result": {...}}; undefined becomes {}
//     },
//     cancel(ctx, reason) {},                // after ctx.signal was aborted (cancel or fatal error)
//     close({ session_id, reason }) {},      // release a session's memory
//     shutdown() {},
//   });
//
// What the SDK guarantees, so that a harness cannot break the protocol by accident:
// - stdout carries protocol lines only: `serve` takes a private handle on it and sends
//   `console.log`/`console.info`/`console.debug` and `process.stdout.write` to stderr;
// - `run` is answered only after every callback of the activation was answered (PROTOCOL.md §7.1);
// - `ctx.signal` is aborted when Brain sends `cancel` or a callback fails with a fatal error, and
//   then the harness's `cancel(ctx, reason)` handler runs, once;
// - after `cancel`, or after a fatal callback error, `run` is answered with that error whatever the
//   handler returned or threw (a result answered after `cancel` would complete the activation);
// - after a fatal callback error other than `cancelled`, every callback of the activation is
//   refused `activation_closed` without being sent, as Brain would refuse it (after a cancel,
//   callbacks such as `transcript.set` still go to Brain).

import { createInterface } from "node:readline";

export const PROTOCOL = "brain/harness/v1";

/** An error the harness answers `run` with: `code` becomes `data.code` (`[a-z0-9_.]`, ≤ 64). */
export class HarnessError extends Error {
  constructor(code, message) {
    super(message ?? code);
    this.name = "HarnessError";
    this.code = code;
  }
}

/** Brain's error answer to a `brain/call`: `code` (data.code), `fatal` (data.fatal), `rpcCode`. */
export class CallError extends Error {
  constructor(code, message, fatal = false, rpcCode = -32000) {
    super(message);
    this.name = "CallError";
    this.code = code;
    this.fatal = fatal;
    this.rpcCode = rpcCode;
  }
}

/** The error a cancelled activation answers `run` with. */
export function cancelledError() {
  return new HarnessError("cancelled", "cancelled");
}

const CODE = /^[a-z0-9_.]{1,64}$/;

/**
 * Takes stdout for the protocol: returns a function writing one line to the real stdout, and from
 * then on sends console.log/info/debug and process.stdout.write to stderr, so a library that
 * prints cannot corrupt the protocol stream. Idempotent.
 */
export function guardStdout() {
  if (guardStdout.write) return guardStdout.write;
  const stdout = process.stdout;
  const realWrite = stdout.write.bind(stdout);
  const toStderr = (...args) => process.stderr.write(...args);
  stdout.write = toStderr;
  for (const name of ["log", "info", "debug"]) {
    console[name] = (...args) => console.error(...args);
  }
  // Brain reads stdout for the worker's whole life: once it is closed there is nobody to answer.
  stdout.on("error", (error) => {
    log(`harness-sdk: stdout failed (${error.code ?? error.message}); exiting`);
    process.exit(error.code === "EPIPE" ? 0 : 1);
  });
  guardStdout.write = (line) => realWrite(line);
  return guardStdout.write;
}

/** Diagnostics on stderr, one line each. */
export function log(...args) {
  process.stderr.write(
    `${args.map((a) => (typeof a === "string" ? a : a instanceof Error ? a.stack : JSON.stringify(a))).join(" ")}\n`,
  );
}

/**
 * Runs the protocol for `harness` until stdin closes. Options (for tests): `input` (a readable
 * stream, default stdin), `write` (a function writing one line, default the guarded stdout),
 * `exit` (called with the exit code when the input ends; default process.exit).
 * Returns a promise that resolves when the input has ended and every run was answered.
 */
export function serve(harness, options = {}) {
  const write = options.write ?? guardStdout();
  const input = options.input ?? process.stdin;
  const connection = new Connection(harness, write);
  const lines = createInterface({ input, crlfDelay: Infinity });
  lines.on("line", (line) => connection.receive(line));
  return new Promise((resolve) => {
    lines.on("close", async () => {
      connection.closed = true;
      connection.failPending("worker_lost", "stdin closed");
      await Promise.allSettled([...connection.runs.values()].map((a) => a.done));
      resolve();
      const exit = options.exit ?? ((code) => process.exit(code));
      exit(0);
    });
  });
}

class Connection {
  constructor(harness, write) {
    this.harness = harness;
    this.writeLine = write;
    this.nextId = 1;
    this.pending = new Map(); // our callback id -> {resolve, reject}
    this.runs = new Map(); // `${session_id}/${sequence}` -> Activation
    this.initialized = false;
    this.maxLineBytes = 16 * 1024 * 1024;
    this.closed = false;
  }

  send(message) {
    const line = JSON.stringify({ jsonrpc: "2.0", ...message });
    if (Buffer.byteLength(line) + 1 > this.maxLineBytes) {
      throw new HarnessError("input_too_large", `a line of ${line.length} bytes exceeds max_line_bytes`);
    }
    this.writeLine(`${line}\n`);
  }

  answer(id, result) {
    this.send({ id, result });
  }

  answerError(id, code, message, rpcCode = -32000) {
    this.send({ id, error: { code: rpcCode, message: String(message).slice(0, 4096), data: { code } } });
  }

  receive(line) {
    let message;
    try {
      message = JSON.parse(line);
    } catch (error) {
      log(`harness-sdk: ignoring a line that is not JSON: ${error.message}`);
      return;
    }
    if (message === null || typeof message !== "object" || Array.isArray(message)) {
      log("harness-sdk: ignoring a line that is not a JSON object");
      return;
    }
    if (typeof message.method === "string") {
      if (message.id === undefined || message.id === null) return; // a notification: v1 has none
      this.request(message).catch((error) => log("harness-sdk: answering", message.method, error));
      return;
    }
    if (message.id !== undefined && ("result" in message || "error" in message)) {
      const waiter = this.pending.get(message.id);
      if (!waiter) {
        log(`harness-sdk: ignoring an answer to unknown id ${JSON.stringify(message.id)}`);
        return;
      }
      this.pending.delete(message.id);
      if (message.error) {
        const e = message.error;
        const data = e.data ?? {};
        waiter.reject(new CallError(data.code ?? "harness_error", e.message ?? "error", data.fatal === true, e.code));
      } else {
        waiter.resolve(message.result);
      }
      return;
    }
    log("harness-sdk: ignoring an object that is neither a request nor a response");
  }

  async request({ id, method, params }) {
    const harness = this.harness;
    switch (method) {
      case "initialize": {
        try {
          if (params && Number.isInteger(params.max_line_bytes)) this.maxLineBytes = params.max_line_bytes;
          const result = await harness.initialize(params ?? {});
          this.initialized = true;
          this.answer(id, result);
        } catch (error) {
          this.answerError(id, errorCode(error), error.message ?? String(error));
        }
        return;
      }
      case "run":
        return this.run(id, params ?? {});
      case "cancel": {
        this.answer(id, {});
        const activation = this.runs.get(key(params?.session_id, params?.sequence));
        if (activation) activation.abort(cancelledError(), true);
        return;
      }
      case "close": {
        try {
          if (harness.close) await harness.close(params ?? {});
        } catch (error) {
          log("harness-sdk: close handler failed:", error);
        }
        this.answer(id, {});
        return;
      }
      case "shutdown": {
        try {
          if (harness.shutdown) await harness.shutdown();
        } catch (error) {
          log("harness-sdk: shutdown handler failed:", error);
        }
        this.answer(id, {});
        return;
      }
      default:
        this.answerError(id, "unknown_method", `unknown method ${JSON.stringify(method)}`, -32601);
    }
  }

  async run(id, params) {
    const { session_id, sequence } = params;
    if (typeof session_id !== "string" || !Number.isInteger(sequence)) {
      this.answerError(id, "invalid_input", "run: session_id must be a string and sequence an integer", -32602);
      return;
    }
    const activation = new Activation(this, params);
    const k = key(session_id, sequence);
    this.runs.set(k, activation);
    let outcome;
    try {
      const value = await this.harness.run(activation.ctx);
      outcome = { value };
    } catch (error) {
      outcome = { error };
    }
    // Await every callback of the activation before answering (PROTOCOL.md §7.1).
    await activation.settle();
    this.runs.delete(k);
    activation.finish();
    try {
      if (activation.abortReason) {
        const reason = activation.abortReason;
        this.answerError(id, reason.code, reason.message);
      } else if (outcome.error) {
        this.answerError(id, errorCode(outcome.error), outcome.error.message ?? String(outcome.error));
      } else {
        this.answer(id, outcome.value === undefined ? {} : { result: outcome.value });
      }
    } catch (error) {
      this.answerError(id, errorCode(error), error.message);
    }
    activation.resolveDone();
  }

  call(params) {
    if (this.closed) return Promise.reject(new CallError("worker_lost", "stdin closed", true));
    const id = `c${this.nextId++}`;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      try {
        this.send({ id, method: "brain/call", params });
      } catch (error) {
        this.pending.delete(id);
        reject(error instanceof CallError ? error : new CallError(errorCode(error), error.message, false));
      }
    });
  }

  failPending(code, message) {
    for (const [id, waiter] of this.pending) {
      this.pending.delete(id);
      waiter.reject(new CallError(code, message, true));
    }
  }
}

function key(session, sequence) {
  return `${session}/${sequence}`;
}

function errorCode(error) {
  const code = error?.code;
  return typeof code === "string" && CODE.test(code) ? code : "harness_error";
}

/** One running activation: its ctx, its abort controller, its outstanding callbacks. */
class Activation {
  constructor(connection, params) {
    this.connection = connection;
    this.controller = new AbortController();
    this.outstanding = new Set();
    this.abortReason = undefined; // the CallError/HarnessError the run must be answered with
    this.finished = false;
    this.done = new Promise((resolve) => (this.resolveDone = resolve));
    const activation = this;
    const call = (method, input) => activation.call(method, input);
    this.ctx = {
      params,
      sessionId: params.session_id,
      sequence: params.sequence,
      stateDir: params.state_dir,
      model: params.model ?? {},
      input: params.input ?? {},
      signal: this.controller.signal,
      call,
      kv: {
        /** The value, or `undefined` when the key is absent (a stored null is `null`). */
        async get(key) {
          const answer = await call("kv.get", { key });
          return answer.found ? answer.value : undefined;
        },
        put: (key, value) => call("kv.put", { key, value }),
        delete: (key) => call("kv.delete", { key }),
      },
      environments: {
        list: async () => (await call("environments.list", {})).environments,
        get: (name) => call("environments.get", { name }),
        setup: (name) => call("environments.setup", { name }),
        call: (name, method, input) => call("environments.call", { name, method, input }),
      },
      /** `brain/call model`: answers the ModelResult. */
      callModel: async (request) => (await call("model", request)).result,
      /** `brain/call tool`: answers the ToolResult. */
      callTool: async (name, input, environment) =>
        (await call("tool", environment === undefined ? { name, input } : { name, input, environment })).result,
      emit: (type, data) => call("emit", { type, data }),
      transcript: { set: (messages) => call("transcript.set", { messages }) },
      events: { read: (after, limit) => call("events.read", limit === undefined ? { after } : { after, limit }) },
      telemetry: (data) => call("telemetry", data),
    };
  }

  call(method, input) {
    if (this.finished) {
      return Promise.reject(new CallError("activation_closed", "the activation was already answered", true));
    }
    // After a fatal error other than `cancelled` Brain admits no callback of the activation
    // (PROTOCOL.md §7.2): refused here, not sent, so the transcript.set a harness makes on its way
    // out is not a callback Brain has to refuse. After a cancel, callbacks still go to Brain.
    const stopped = this.abortReason;
    if (stopped instanceof CallError && stopped.fatal && stopped.code !== "cancelled") {
      return Promise.reject(
        new CallError("activation_closed", `the activation was stopped by a fatal ${stopped.code} error`, true),
      );
    }
    const promise = this.connection.call({
      session_id: this.ctx.sessionId,
      sequence: this.ctx.sequence,
      method,
      input: input ?? {},
    });
    this.outstanding.add(promise);
    const settled = () => this.outstanding.delete(promise);
    promise.then(settled, (error) => {
      settled();
      if (error instanceof CallError && error.fatal) this.abort(error, false);
    });
    return promise;
  }

  /** Aborts ctx.signal with `reason` (first one wins), then runs the harness's cancel handler. */
  abort(reason, fromCancel) {
    if (this.finished || this.abortReason) return;
    this.abortReason = reason;
    this.controller.abort(reason);
    const handler = this.connection.harness.cancel;
    if (handler) {
      Promise.resolve()
        .then(() => handler(this.ctx, reason, fromCancel))
        .catch((error) => log("harness-sdk: cancel handler failed:", error));
    }
  }

  async settle() {
    while (this.outstanding.size > 0) {
      await Promise.allSettled([...this.outstanding]);
    }
  }

  finish() {
    this.finished = true;
  }
}
