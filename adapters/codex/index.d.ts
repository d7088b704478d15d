// Types of @brain/agentloop-codex.
import type { EnvironmentGrant, Selection } from "@brain/client";

/** The Codex adapter's configuration keys (docs/ADAPTERS.md). */
export interface CodexConfiguration {
  /** The token count at which Codex compacts its thread. Default: context_window − max_output_tokens. */
  auto_compact_token_limit?: number;
}

/**
 * The `agentloop` of a session request running this adapter: `name` is the registration's name
 * (default "codex"), `configuration` its session configuration (a key it does not have fails to
 * compile), `environments` the harness's grants.
 */
export function codex(options?: {
  name?: string;
  configuration?: CodexConfiguration;
  environments?: EnvironmentGrant[];
}): Selection<CodexConfiguration>;
