// A typed session on the Codex adapter through Brain's HTTP API (type-checked by scripts/test).
import { BrainClient } from "@brain/client";
import { codex } from "@brain/agentloop-codex";

export async function hello(token: string): Promise<unknown> {
  const brain = new BrainClient({ token });
  const session = await brain.createSession(codex({ configuration: { auto_compact_token_limit: 150000 } }), {
    model: { provider: "scripted", name: "default", context_window: 200000, max_output_tokens: 8192 },
  });
  const answer = await brain.send(session.session_id, "hello");
  for await (const event of brain.events(session.session_id)) {
    if (event.type === "activation_finished") break;
  }
  return answer.result;
}

// A configuration key the adapter does not have fails to compile.
// @ts-expect-error: not a key of the Codex adapter's configuration
codex({ configuration: { auto_compact_limit: 150000 } });
