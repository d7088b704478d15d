// A typed session on the Pi adapter through Brain's HTTP API (type-checked by scripts/test).
import { BrainClient } from "@brain/client";
import { pi } from "@brain/agentloop-pi";

export async function hello(token: string): Promise<unknown> {
  const brain = new BrainClient({ token });
  const session = await brain.createSession(pi({ configuration: { compaction: false } }), {
    model: { provider: "scripted", name: "default", context_window: 200000, max_output_tokens: 8192 },
  });
  const answer = await brain.send(session.session_id, "hello");
  for await (const event of brain.events(session.session_id)) {
    if (event.type === "activation_finished") break;
  }
  return answer.result;
}

// A configuration key the adapter does not have fails to compile.
// @ts-expect-error: not a key of the Pi adapter's configuration
pi({ configuration: { compactoin: false } });
