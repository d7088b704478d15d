// @brain/agentloop-pi: the session's selection for the Pi adapter. The harness itself is
// `@brain/agentloop-pi/runtime` (and the `brain-agentloop-pi` command).

/** The `agentloop` of a session request running this adapter. */
export function pi({ configuration = {}, environments = [], name = "pi" } = {}) {
  return { name, configuration, environments };
}
