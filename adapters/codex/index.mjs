// @brain/agentloop-codex: the session's selection for the Codex adapter. The harness itself is
// `@brain/agentloop-codex/runtime` (and the `brain-agentloop-codex` command).

/** The `agentloop` of a session request running this adapter. */
export function codex({ configuration = {}, environments = [], name = "codex" } = {}) {
  return { name, configuration, environments };
}
