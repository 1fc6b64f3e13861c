"""python -m decode_service: run one decode worker."""

import argparse

from decode_service.server import DecodeConfig, serve
from pdserve.serving import configure_logging, run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_service", description=__doc__)
    DecodeConfig.add_args(parser)
    args = parser.parse_args(argv)
    try:
        config = DecodeConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging()
    run(serve(config))


if __name__ == "__main__":
    main()
