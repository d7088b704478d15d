// Tests of the harness SDK: the protocol loop driven over an in-memory stream (Brain's side is
// played by the test), and the stdout guard in a real child process.

import { test } from "node:test";
import assert from "node:assert/strict";
import { PassThrough } from "node:stream";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { serve, HarnessError, PROTOCOL } from "../index.mjs";

const WAIT_MS = 5000;

/** A harness served over in-memory pipes; `next()` answers the next line the harness wrote. */
function harness(handlers) {
  const input = new PassThrough();
  const lines = [];
  const waiters = [];
  const write = (line) => {
    assert.ok(line.endsWith("\n"), "every protocol line ends with a newline");
    const message = JSON.parse(line);
    const waiter = waiters.shift();
    if (waiter) waiter(message);
    else lines.push(message);
  };
  let exited;
  const served = serve(
    {
      initialize: () => ({ protocol: PROTOCOL, identity: { name: "t", version: "1" }, state_version: "1" }),
      ...handlers,
    },
    { input, write, exit: (code) => (exited = code) },
  );
  return {
    send: (message) => input.write(`${JSON.stringify({ jsonrpc: "2.0", ...message })}\n`),
    next: () =>
      lines.length > 0
        ? Promise.resolve(lines.shift())
        : new Promise((resolve, reject) => {
            const timer = setTimeout(() => reject(new Error("no line within the deadline")), WAIT_MS);
            waiters.push((m) => {
              clearTimeout(timer);
              resolve(m);
            });
          }),
    pendingLines: () => lines.length,
    end: async () => {
      input.end();
      await served;
      return exited;
    },
  };
}

/** Brain's answer to callback `id`: the fatal `journal_failed` error. */
const journalFailed = (id) => ({
  id,
  error: { code: -32000, message: "journal broke", data: { code: "journal_failed", fatal: true } },
});

const run = (id, sequence = 2) => ({
  id,
  method: "run",
  params: { session_id: "ses_01234567890123456789", sequence, state_dir: "/tmp/x", model: {}, input: {} },
});

test("initialize is answered with the harness's declarations; unknown methods are refused", async () => {
  const h = harness({});
  h.send({ id: 1, method: "initialize", params: { protocol: PROTOCOL, max_line_bytes: 1024 } });
  assert.deepEqual(await h.next(), {
    jsonrpc: "2.0",
    id: 1,
    result: { protocol: PROTOCOL, identity: { name: "t", version: "1" }, state_version: "1" },
  });
  h.send({ id: 2, method: "frobnicate", params: {} });
  const refused = await h.next();
  assert.equal(refused.id, 2);
  assert.equal(refused.error.code, -32601);
  assert.equal(refused.error.data.code, "unknown_method");
  assert.match(refused.error.message, /frobnicate/);
  assert.equal(await h.end(), 0);
});

test("run answers the handler's value as result, undefined as {}, and a HarnessError by its code", async () => {
  const h = harness({
    run: (ctx) => {
      if (ctx.sequence === 2) return { text: "hi" };
      if (ctx.sequence === 3) return undefined;
      throw new HarnessError("model_refused", "no thanks");
    },
  });
  h.send(run(7, 2));
  assert.deepEqual(await h.next(), { jsonrpc: "2.0", id: 7, result: { result: { text: "hi" } } });
  h.send(run(8, 3));
  assert.deepEqual(await h.next(), { jsonrpc: "2.0", id: 8, result: {} });
  h.send(run(9, 4));
  const failed = await h.next();
  assert.equal(failed.error.data.code, "model_refused");
  assert.equal(failed.error.message, "no thanks");
  await h.end();
});

test("ctx.call and ctx.kv send brain/call naming the activation and resolve with Brain's answer", async () => {
  const h = harness({
    run: async (ctx) => {
      const plan = await ctx.kv.get("plan");
      const missing = await ctx.kv.get("nothing");
      return { plan, missing: missing === undefined };
    },
  });
  h.send(run(1, 5));
  const get = await h.next();
  assert.equal(get.method, "brain/call");
  assert.deepEqual(get.params, {
    session_id: "ses_01234567890123456789",
    sequence: 5,
    method: "kv.get",
    input: { key: "plan" },
  });
  h.send({ id: get.id, result: { found: true, value: "step 2" } });
  const second = await h.next();
  assert.deepEqual(second.params.input, { key: "nothing" });
  h.send({ id: second.id, result: { found: false } });
  assert.deepEqual((await h.next()).result, { result: { plan: "step 2", missing: true } });
  await h.end();
});

test("ctx.environments maps onto the environments callbacks", async () => {
  const h = harness({
    run: async (ctx) => {
      const list = await ctx.environments.list();
      const called = await ctx.environments.call("workspace", "bash", { command: "ls" });
      return { list, called };
    },
  });
  h.send(run(1));
  const list = await h.next();
  assert.equal(list.params.method, "environments.list");
  h.send({ id: list.id, result: { environments: [{ name: "workspace", sequence: 1, status: "ready" }] } });
  const call = await h.next();
  assert.equal(call.params.method, "environments.call");
  assert.deepEqual(call.params.input, { name: "workspace", method: "bash", input: { command: "ls" } });
  h.send({ id: call.id, result: { sequence: 9, result: { content: [] } } });
  const answer = await h.next();
  assert.equal(answer.result.result.list[0].name, "workspace");
  assert.equal(answer.result.result.called.sequence, 9);
  await h.end();
});

test("cancel is answered at once, aborts ctx.signal, runs the cancel handler, and run ends cancelled", async () => {
  const events = [];
  const h = harness({
    run: (ctx) =>
      new Promise((resolve) => {
        ctx.signal.addEventListener("abort", () => {
          events.push(`aborted:${ctx.signal.reason.code}`);
          // Even a result after cancel is answered as cancelled by the SDK.
          setTimeout(() => resolve({ late: true }), 10);
        });
      }),
    cancel: (ctx, reason) => events.push(`cancel-handler:${reason.code}`),
  });
  h.send(run(3, 4));
  h.send({ id: 4, method: "cancel", params: { session_id: "ses_01234567890123456789", sequence: 4 } });
  assert.deepEqual(await h.next(), { jsonrpc: "2.0", id: 4, result: {} });
  const ended = await h.next();
  assert.equal(ended.id, 3);
  assert.equal(ended.error.data.code, "cancelled");
  assert.deepEqual(events, ["aborted:cancelled", "cancel-handler:cancelled"]);
  // A repeated or unknown cancel is answered {} too.
  h.send({ id: 5, method: "cancel", params: { session_id: "ses_01234567890123456789", sequence: 4 } });
  assert.deepEqual((await h.next()).result, {});
  await h.end();
});

test("a fatal callback error aborts ctx.signal, runs the cancel handler, and run ends with its code", async () => {
  let handled;
  const h = harness({
    run: async (ctx) => {
      try {
        await ctx.call("model", { messages: [] });
      } catch {
        // The harness swallows the error; the SDK still answers with the fatal code.
      }
      return { aborted: ctx.signal.aborted };
    },
    cancel: (ctx, reason) => (handled = reason.code),
  });
  h.send(run(1));
  const call = await h.next();
  h.send(journalFailed(call.id));
  const ended = await h.next();
  assert.equal(ended.error.data.code, "journal_failed");
  assert.equal(ended.error.message, "journal broke");
  assert.equal(handled, "journal_failed");
  await h.end();
});

test("after a fatal callback error other than cancelled, callbacks are refused without being sent", async () => {
  const h = harness({
    run: async (ctx) => {
      await ctx.callModel({ messages: [] }).catch(() => {});
      const refused = await ctx.transcript.set([]).catch((error) => error);
      return { code: refused.code, fatal: refused.fatal };
    },
  });
  h.send(run(1));
  const call = await h.next();
  h.send(journalFailed(call.id));
  // The next line is the run's answer: transcript.set never reached the wire.
  const ended = await h.next();
  assert.equal(ended.method, undefined, JSON.stringify(ended));
  assert.equal(ended.id, 1);
  assert.equal(ended.error.data.code, "journal_failed");
  assert.equal(h.pendingLines(), 0);
  await h.end();
});

test("after a cancel, callbacks still reach Brain", async () => {
  const h = harness({
    run: (ctx) =>
      new Promise((resolve) => {
        ctx.signal.addEventListener("abort", () => resolve(ctx.transcript.set([]).then(() => ({}))));
      }),
  });
  h.send(run(3, 4));
  h.send({ id: 4, method: "cancel", params: { session_id: "ses_01234567890123456789", sequence: 4 } });
  assert.deepEqual(await h.next(), { jsonrpc: "2.0", id: 4, result: {} });
  const call = await h.next();
  assert.equal(call.params.method, "transcript.set");
  h.send({ id: call.id, result: {} });
  const ended = await h.next();
  assert.equal(ended.error.data.code, "cancelled");
  await h.end();
});

test("a non-fatal callback error is the harness's to handle and does not abort", async () => {
  const h = harness({
    run: async (ctx) => {
      try {
        await ctx.call("environments.get", { name: "secret" });
      } catch (error) {
        return { code: error.code, fatal: error.fatal, aborted: ctx.signal.aborted };
      }
    },
  });
  h.send(run(1));
  const call = await h.next();
  h.send({ id: call.id, error: { code: -32000, message: "no", data: { code: "not_granted", fatal: false } } });
  assert.deepEqual((await h.next()).result.result, { code: "not_granted", fatal: false, aborted: false });
  await h.end();
});

test("run is answered only after every callback of the activation was answered", async () => {
  const h = harness({
    run: (ctx) => {
      // Fire and forget: the handler returns while its callback is still unanswered.
      ctx.call("emit", { type: "progress", data: {} }).catch(() => {});
      return { early: true };
    },
  });
  h.send(run(1));
  const emit = await h.next();
  assert.equal(emit.params.method, "emit");
  // Let the event loop run: no run answer may appear while the callback is outstanding.
  await new Promise((resolve) => setImmediate(resolve));
  await new Promise((resolve) => setTimeout(resolve, 20));
  assert.equal(h.pendingLines(), 0, "run was answered while a callback was outstanding");
  h.send({ id: emit.id, result: { sequence: 3 } });
  assert.deepEqual((await h.next()).result, { result: { early: true } });
  await h.end();
});

test("close and shutdown reach their handlers and are answered {}", async () => {
  const seen = [];
  const h = harness({
    close: (params) => seen.push(`close:${params.reason}`),
    shutdown: () => seen.push("shutdown"),
  });
  h.send({ id: 1, method: "close", params: { session_id: "ses_01234567890123456789", reason: "passivated" } });
  assert.deepEqual((await h.next()).result, {});
  h.send({ id: 2, method: "shutdown", params: {} });
  assert.deepEqual((await h.next()).result, {});
  assert.deepEqual(seen, ["close:passivated", "shutdown"]);
  await h.end();
});

test("in a real process, stdout carries protocol lines only, whatever the harness prints", async () => {
  const fixture = fileURLToPath(new URL("./fixtures/printing-harness.mjs", import.meta.url));
  const child = spawn(process.execPath, [fixture], { stdio: ["pipe", "pipe", "pipe"] });
  let stdout = "";
  let stderr = "";
  child.stdout.on("data", (d) => (stdout += d));
  child.stderr.on("data", (d) => (stderr += d));
  child.stdin.write(`${JSON.stringify({ jsonrpc: "2.0", id: 1, method: "initialize", params: {} })}\n`);
  child.stdin.end();
  const code = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("the harness did not exit")), WAIT_MS);
    child.on("exit", (c) => {
      clearTimeout(timer);
      resolve(c);
    });
  });
  assert.equal(code, 0, stderr);
  const lines = stdout.split("\n").filter((l) => l !== "");
  assert.equal(lines.length, 1, `stdout: ${stdout}`);
  assert.equal(JSON.parse(lines[0]).result.identity.name, "printing");
  assert.match(stderr, /console\.log goes to stderr/);
  assert.match(stderr, /stdout\.write goes to stderr/);
});
