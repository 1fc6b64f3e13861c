"""python -m decode_service: run one decode worker."""

import sys

from decode_service.config import DecodeConfig
from decode_service.server import serve
from serving.server import main

if __name__ == "__main__":
    main("python -m decode_service", __doc__, DecodeConfig, serve, sys.argv[1:])
