// @brain/agentloop-opencode: the session's selection for the OpenCode adapter. The harness itself
// is `@brain/agentloop-opencode/runtime` (and the `brain-agentloop-opencode` command).

/** The `agentloop` of a session request running this adapter. */
export function opencode({ configuration = {}, environments = [], name = "opencode" } = {}) {
  return { name, configuration, environments };
}
