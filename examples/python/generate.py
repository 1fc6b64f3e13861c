"""Stream a completion from a pdserve gateway with the generated Python stubs, and cancel by leaving the stream.

    python examples/python/generate.py --address 127.0.0.1:50051 "The capital of France is"
    python examples/python/generate.py --cancel-after 5 "Tell me a long story"

Stubs: `python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. protos/gateway.proto` from the
repository root (`make install` does it). Prints one JSON line per response message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root: protos/
from protos import gateway_pb2, gateway_pb2_grpc  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-after", type=int, default=0, help="leave the stream after this many tokens")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""))
    args = parser.parse_args()

    request = gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with grpc.insecure_channel(args.address) as channel:
        responses = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60, metadata=metadata)
        received = 0
        for response in responses:  # one message per batch of new tokens; the last has finish_reason and usage
            received += len(response.token_ids)
            print(json.dumps({"request_id": response.request_id, "token_ids": list(response.token_ids),
                              "text": response.text, "finish_reason": response.finish_reason}), flush=True)
            if args.cancel_after and received >= args.cancel_after:
                # Leaving the stream: cancel the call, and the gateway cancels the request on every worker.
                responses.cancel()
                print(json.dumps({"cancelled_after": received}), flush=True)
                break


if __name__ == "__main__":
    main()
