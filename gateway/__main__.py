"""python -m gateway: run the gateway in front of running prefill and decode workers."""

import argparse

from gateway.server import GatewayConfig, serve
from pdserve.serving import configure_logging, run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    GatewayConfig.add_args(parser)
    args = parser.parse_args(argv)
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging()
    run(serve(config))


if __name__ == "__main__":
    main()
