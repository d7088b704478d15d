// Types of @brain/agentloop-pi.
import type { EnvironmentGrant, Selection } from "@brain/client";

/** The Pi adapter's configuration keys (docs/ADAPTERS.md). */
export interface PiConfiguration {
  /** Pi's automatic compaction: on or off, or its settings. Default: Pi's own. */
  compaction?: boolean | { enabled?: boolean; reserve_tokens?: number; keep_recent_tokens?: number };
}

/**
 * The `agentloop` of a session request running this adapter: `name` is the registration's name
 * (default "pi"), `configuration` its session configuration (a key it does not have fails to
 * compile), `environments` the harness's grants.
 */
export function pi(options?: {
  name?: string;
  configuration?: PiConfiguration;
  environments?: EnvironmentGrant[];
}): Selection<PiConfiguration>;
