// A typed harness on the SDK (type-checked by scripts/test): echoes the model's text.
import { PROTOCOL, HarnessError, serve, type Harness } from "@brain/harness-sdk";

const harness: Harness = {
  initialize: () => ({ protocol: PROTOCOL, identity: { name: "echo", version: "1.0.0" }, state_version: "1" }),
  async run(ctx) {
    if (ctx.signal.aborted) throw new HarnessError("cancelled");
    const answer = await ctx.callModel({ messages: [{ role: "user", content: ctx.input.input?.content ?? [] }] });
    await ctx.kv.put("last", answer.stop_reason);
    await ctx.transcript.set([{ role: "assistant", content: answer.message.content }]);
    const text = answer.message.content.map((block) => (block.type === "text" ? block.text : "")).join("");
    return { text };
  },
};

export const served: Promise<void> = serve(harness);
