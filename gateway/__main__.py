"""python -m gateway: run the gateway in front of running prefill and decode workers."""

import sys

from gateway.config import GatewayConfig
from gateway.server import serve
from serving.server import main

if __name__ == "__main__":
    main("python -m gateway", __doc__, GatewayConfig, serve, sys.argv[1:])
