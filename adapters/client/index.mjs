// @brain/client: Brain's HTTP API (docs/OPERATIONS.md) from Node 20.6+, with the global fetch.
// Every method refuses with a BrainError naming the status and Brain's error code.

/** Brain's error answer: `status` (HTTP), `code` and `message` (its `error` object). */
export class BrainError extends Error {
  constructor(status, code, message) {
    super(`${status} ${code}: ${message}`);
    this.name = "BrainError";
    this.status = status;
    this.code = code;
  }
}

export class BrainClient {
  /** `url`: Brain's address (default http://127.0.0.1:3210); `token`: the operator token. */
  constructor({ url = "http://127.0.0.1:3210", token } = {}) {
    if (!token) throw new TypeError("BrainClient: a token is required (brain-data/operator.token)");
    this.url = url.replace(/\/+$/, "");
    this.token = token;
  }

  async request(method, path, body, headers = {}) {
    const response = await fetch(`${this.url}${path}`, {
      method,
      headers: {
        authorization: `Bearer ${this.token}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
        ...headers,
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    const value = text ? JSON.parse(text) : undefined;
    if (!response.ok) {
      const error = value?.error ?? {};
      throw new BrainError(response.status, error.code ?? "http_error", error.message ?? text);
    }
    return value;
  }

  /**
   * Creates a session from an adapter's selection (`pi({...})`) and the rest of the request. With
   * `idempotencyKey`, a retry with the same key and request gets the session the first made.
   */
  createSession(selection, request = {}, { idempotencyKey } = {}) {
    return this.request("POST", "/v1/sessions", { ...request, agentloop: selection }, keyed(idempotencyKey));
  }

  /**
   * Sends a message (text or blocks) and waits for the activation's outcome. With
   * `idempotencyKey`, a retry with the same key and content gets the first attempt's activation
   * and its outcome, and admits nothing (docs/OPERATIONS.md, "Retrying safely").
   */
  send(sessionId, content, { idempotencyKey } = {}) {
    return this.request("POST", messages(sessionId), { content: blocks(content) }, keyed(idempotencyKey));
  }

  /** Admits the activation and answers at once (`Prefer: respond-async`); `idempotencyKey` as for `send`. */
  start(sessionId, content, { idempotencyKey } = {}) {
    return this.request("POST", messages(sessionId), { content: blocks(content) }, {
      prefer: "respond-async",
      ...keyed(idempotencyKey),
    });
  }

  session(sessionId) {
    return this.request("GET", `/v1/sessions/${encodeURIComponent(sessionId)}`);
  }

  cancel(sessionId) {
    return this.request("POST", `/v1/sessions/${encodeURIComponent(sessionId)}/cancel`, {});
  }

  close(sessionId) {
    return this.request("POST", `/v1/sessions/${encodeURIComponent(sessionId)}/close`, {});
  }

  delete(sessionId) {
    return this.request("DELETE", `/v1/sessions/${encodeURIComponent(sessionId)}`);
  }

  /** The session's events after `after`, one page. */
  eventsPage(sessionId, after = 0) {
    return this.request("GET", `/v1/sessions/${encodeURIComponent(sessionId)}/events?after=${after}`);
  }

  /** Follows the session's events over SSE from `after`, until `signal` aborts or Brain ends the stream. */
  async *events(sessionId, { after = 0, signal } = {}) {
    const response = await fetch(`${this.url}/v1/sessions/${encodeURIComponent(sessionId)}/events?after=${after}`, {
      headers: { authorization: `Bearer ${this.token}`, accept: "text/event-stream" },
      signal,
    });
    if (!response.ok) {
      const error = (await response.json().catch(() => ({}))).error ?? {};
      throw new BrainError(response.status, error.code ?? "http_error", error.message ?? "");
    }
    const decoder = new TextDecoder();
    let buffer = "";
    for await (const chunk of response.body) {
      buffer += decoder.decode(chunk, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) yield JSON.parse(data);
      }
    }
  }
}

const blocks = (content) => (typeof content === "string" ? [{ type: "text", text: content }] : content);
const messages = (sessionId) => `/v1/sessions/${encodeURIComponent(sessionId)}/messages`;
const keyed = (key) => (key === undefined ? {} : { "idempotency-key": key });
