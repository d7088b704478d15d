#!/usr/bin/env node
// brain-agentloop-opencode: the OpenCode adapter as a command, for a registration's "command".
import { main } from "./runtime.mjs";

await main();
