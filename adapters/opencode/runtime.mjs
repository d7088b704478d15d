// @brain/agentloop-opencode/runtime: the harness implementation. `main()` takes stdout for the
// protocol and serves brain/harness/v1 on stdin/stdout until Brain closes stdin.

/** Starts the harness. */
export function main() {
  return import("./harness.mjs");
}
