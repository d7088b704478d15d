// A typed session on the OpenCode adapter through Brain's HTTP API (type-checked by scripts/test).
import { BrainClient } from "@brain/client";
import { opencode } from "@brain/agentloop-opencode";

export async function hello(token: string): Promise<unknown> {
  const brain = new BrainClient({ token });
  const session = await brain.createSession(opencode(), {
    model: { provider: "scripted", name: "default", context_window: 200000, max_output_tokens: 8192 },
  });
  const answer = await brain.send(session.session_id, "hello");
  for await (const event of brain.events(session.session_id)) {
    if (event.type === "activation_finished") break;
  }
  return answer.result;
}

// The adapter has no configuration keys: any key fails to compile.
// @ts-expect-error: not a key of the OpenCode adapter's configuration
opencode({ configuration: { model: "x" } });
