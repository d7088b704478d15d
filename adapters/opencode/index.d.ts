// Types of @brain/agentloop-opencode.
import type { EnvironmentGrant, Selection } from "@brain/client";

/** The OpenCode adapter's configuration keys (docs/ADAPTERS.md): it has none. */
export type OpencodeConfiguration = Record<string, never>;

/**
 * The `agentloop` of a session request running this adapter: `name` is the registration's name
 * (default "opencode"), `configuration` its session configuration (it has no keys: any key fails
 * to compile), `environments` the harness's grants.
 */
export function opencode(options?: {
  name?: string;
  configuration?: OpencodeConfiguration;
  environments?: EnvironmentGrant[];
}): Selection<OpencodeConfiguration>;
