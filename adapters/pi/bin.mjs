#!/usr/bin/env node
// brain-agentloop-pi: the Pi adapter as a command, for a registration's "command".
import { main } from "./runtime.mjs";

await main();
