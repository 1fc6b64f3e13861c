// Stream a completion from a pdserve gateway with @grpc/grpc-js, loading protos/gateway.proto at run time.
//
//   cd examples/node && npm install
//   node generate.js --address 127.0.0.1:50051 --max-tokens 16 "The capital of France is"
//
// Prints the text as it streams to stderr, then one JSON object on stdout: token_ids, text, finish_reason,
// usage. PDSERVE_API_KEY, when set, is sent as `authorization: Bearer ...`.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const args = { address: "127.0.0.1:50051", maxTokens: 32, prompt: "" };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--address") args.address = argv[++i];
    else if (argv[i] === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else args.prompt = argv[i];
  }
  if (!args.prompt) throw new Error("usage: node generate.js [--address HOST:PORT] [--max-tokens N] PROMPT");
  return args;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const definition = protoLoader.loadSync(path.join(__dirname, "..", "..", "protos", "gateway.proto"), {
    keepCase: true, // field names as in the .proto: token_ids, finish_reason
    longs: String,
    defaults: true,
  });
  const { Gateway } = grpc.loadPackageDefinition(definition).pdserve.v1;
  const client = new Gateway(args.address, grpc.credentials.createInsecure());

  const metadata = new grpc.Metadata();
  if (process.env.PDSERVE_API_KEY) metadata.set("authorization", `Bearer ${process.env.PDSERVE_API_KEY}`);
  const deadline = new Date(Date.now() + 60_000);
  // Optional fields (max_tokens, temperature) are set like any other; temperature 0 is greedy.
  const call = client.Generate(
    { prompt: args.prompt, max_tokens: args.maxTokens, temperature: 0 }, metadata, { deadline });

  const result = { token_ids: [], text: "", finish_reason: "", usage: null };
  call.on("data", (response) => {
    result.token_ids.push(...response.token_ids);
    result.text += response.text;
    process.stderr.write(response.text);
    if (response.finish_reason) {
      result.finish_reason = response.finish_reason;
      result.usage = response.usage;
    }
  });
  call.on("error", (err) => {
    console.error(`\n${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    process.stderr.write("\n");
    console.log(JSON.stringify(result));
    client.close();
  });
}

main();
