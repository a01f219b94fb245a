// Sessions from Node: open a session, run two streamed turns, fork it, and print how
// many prompt tokens each turn took from the prefix cache. Then one constrained call:
// `tool_choice` names a function, so the reply is always a valid call of it.
//
//   node demo.js [ENDPOINT] [--max-tokens N] [--ignore-eos] [--json]
//                [--server-key DIR/server.key --client-key DIR/clients/NAME.key_secret]
//
// ENDPOINT defaults to $RADIXLM_ENDPOINT (the address `radixlm serve` prints).
// --ignore-eos makes every turn exactly --max-tokens long; --json prints one JSON summary
// line at the end (tests read both).
"use strict";

const { Client } = require("./client");

function parseArgs(argv) {
  const args = { endpoint: process.env.RADIXLM_ENDPOINT, maxTokens: 16, ignoreEos: false, json: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--json") args.json = true;
    else if (arg === "--ignore-eos") args.ignoreEos = true;
    else if (arg === "--max-tokens") args.maxTokens = Number.parseInt(argv[++i], 10);
    else if (arg === "--server-key") args.serverKey = argv[++i];
    else if (arg === "--client-key") args.clientKey = argv[++i];
    else if (arg === "-h" || arg === "--help") args.help = true;
    else args.endpoint = arg;
  }
  return args;
}

async function streamedTurn(client, session, content, args) {
  process.stdout.write(`user> ${content}\nassistant> `);
  const done = await client.generate(
    { messages: [{ role: "user", content }] },
    {
      session,
      // Greedy, so a run is reproducible.
      sampling: { max_tokens: args.maxTokens, temperature: 0, ignore_eos: args.ignoreEos },
      onChunk: (chunk) => process.stdout.write(chunk.text),
    },
  );
  const { prompt_tokens, cached_tokens, completion_tokens } = done.usage;
  process.stdout.write(
    `\n  [${done.finish_reason}] prompt ${prompt_tokens} tokens, ${cached_tokens} from cache, ` +
      `${completion_tokens} generated; history now ${done.session_length} tokens\n`,
  );
  return done;
}

const WEATHER = {
  name: "get_weather",
  description: "Current weather in a city",
  parameters: {
    type: "object",
    properties: { city: { type: "string", pattern: "^[A-Z][a-z]{1,15}$" }, unit: { enum: ["C", "F"] } },
    required: ["city", "unit"],
    additionalProperties: false,
  },
};

// A text prompt keeps this short; with chat messages the model's template shows the tool.
async function constrainedCall(client) {
  const done = await client.generate(
    { text: "Weather in Paris, in Celsius:" },
    { tools: [WEATHER], tool_choice: { name: "get_weather" }, sampling: { max_tokens: 96, temperature: 0 } },
  );
  const [call] = done.tool_calls ?? [];
  if (!call) throw new Error(`no tool call in ${JSON.stringify(done.text)}`);
  console.log(`tool call: ${call.name}(${call.arguments})`);
  return call;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  if (args.help || !args.endpoint) {
    console.error(
      "usage: node demo.js ENDPOINT [--max-tokens N] [--ignore-eos] [--json]  (or set RADIXLM_ENDPOINT)",
    );
    process.exit(args.help ? 0 : 2);
  }
  const client = await Client.connect(args.endpoint, {
    clientName: "node-demo",
    serverKey: args.serverKey,
    clientKey: args.clientKey,
  });
  try {
    const { model, protocol_version, server_version } = client.welcome;
    console.log(`connected to ${args.endpoint}: ${model} (server ${server_version}, protocol ${protocol_version})`);

    const { session } = await client.openSession();
    console.log(`opened session ${session}`);
    const first = await streamedTurn(client, session, "Name a colour.", args);
    const second = await streamedTurn(client, session, "And another one?", args);

    const [fork] = await client.forkSession(session, 1);
    console.log(`forked ${session} -> ${fork}`);
    const forked = await streamedTurn(client, fork, "Now name a fruit.", args);

    for (const id of [session, fork]) await client.closeSession(id);

    const call = await constrainedCall(client);
    const turns = { first, second, forked };
    if (args.json) {
      const summary = {};
      for (const [name, done] of Object.entries(turns)) {
        summary[name] = { usage: done.usage, session_length: done.session_length, text: done.text };
      }
      summary.tool_call = call;
      console.log(JSON.stringify(summary));
    }
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`demo failed: ${err.message}`);
  process.exit(1);
});
