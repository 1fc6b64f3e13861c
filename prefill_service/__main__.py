"""python -m prefill_service: run one prefill worker."""

import argparse

from pdserve.serving import configure_logging, run
from prefill_service.server import PrefillConfig, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__)
    PrefillConfig.add_args(parser)
    args = parser.parse_args(argv)
    try:
        config = PrefillConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging()
    run(serve(config))


if __name__ == "__main__":
    main()
