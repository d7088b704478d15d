#!/usr/bin/env node
// brain-agentloop-codex: the Codex adapter as a command, for a registration's "command".
import { main } from "./runtime.mjs";

await main();
