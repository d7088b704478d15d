/** Starts the OpenCode harness on stdin/stdout (brain/harness/v1). */
export function main(): Promise<unknown>;
