// Types of @brain/client (index.mjs).
import type { Block, Message, ModelMetadata, ToolDefinition } from "@brain/harness-sdk";

/** What an adapter package's constructor returns (`pi({...})`): the request's `agentloop`. */
export interface Selection<Configuration = Record<string, unknown>> {
  name: string;
  configuration: Configuration;
  environments: EnvironmentGrant[];
}

/** The harness's access to one of the session's environments. */
export interface EnvironmentGrant {
  environment: string;
  permissions: ("read" | "call" | "setup")[];
}

/** An environment the session declares: its driver and the driver's configuration. */
export interface EnvironmentDecl {
  name: string;
  driver: "local" | "sandbox" | string;
  configuration?: Record<string, unknown>;
}

/** The rest of a `POST /v1/sessions` body. */
export interface SessionRequest {
  model?: ModelMetadata;
  system?: string;
  tools?: ToolDefinition[];
  environments?: EnvironmentDecl[];
  transcript?: Message[];
  metadata?: Record<string, unknown>;
}

/** A session, as Brain shows it. */
export interface SessionView {
  session_id: string;
  status: string;
  [key: string]: unknown;
}

/** An activation's answer. */
export interface ActivationAnswer {
  session_id: string;
  sequence: number;
  outcome?: "completed" | "failed" | "cancelled" | string;
  result?: unknown;
  error?: { code: string; message: string };
  [key: string]: unknown;
}

/** One journal record, as the events routes show it. */
export interface SessionEvent {
  sequence: number;
  type: string;
  data: unknown;
  [key: string]: unknown;
}

/** Brain's error answer. */
export class BrainError extends Error {
  constructor(status: number, code: string, message: string);
  status: number;
  code: string;
}

export class BrainClient {
  constructor(options: { url?: string; token: string });
  url: string;
  /** With `idempotencyKey` (1–255 visible ASCII characters), a retry gets the first attempt's session. */
  createSession<C>(
    selection: Selection<C>,
    request?: SessionRequest,
    options?: { idempotencyKey?: string },
  ): Promise<SessionView>;
  /** With `idempotencyKey`, a retry gets the first attempt's activation and outcome. */
  send(sessionId: string, content: string | Block[], options?: { idempotencyKey?: string }): Promise<ActivationAnswer>;
  start(sessionId: string, content: string | Block[], options?: { idempotencyKey?: string }): Promise<ActivationAnswer>;
  session(sessionId: string): Promise<SessionView>;
  cancel(sessionId: string): Promise<unknown>;
  close(sessionId: string): Promise<SessionView>;
  delete(sessionId: string): Promise<unknown>;
  eventsPage(sessionId: string, after?: number): Promise<{ events: SessionEvent[]; next_after: number }>;
  events(sessionId: string, options?: { after?: number; signal?: AbortSignal }): AsyncIterable<SessionEvent>;
}
