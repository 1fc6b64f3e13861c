"""python -m prefill_service: run one prefill worker."""

import sys

from prefill_service.config import PrefillConfig
from prefill_service.server import serve
from serving.server import main

if __name__ == "__main__":
    main("python -m prefill_service", __doc__, PrefillConfig, serve, sys.argv[1:])
