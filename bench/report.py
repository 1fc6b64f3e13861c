"""How every benchmark publishes a run: JSON (and a plot) under `--out`, and a table or one JSON object on stdout."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_output_args(parser: argparse.ArgumentParser, name: str, plot: bool = True) -> None:
    """The two flags `publish` reads: --json, and --out (where `<name>.json`, and the plot, are written)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    files = f"{name}.json and {name}.png" if plot else f"{name}.json"
    parser.add_argument("--out", default="bench/results", help=f"directory for {files}")


def publish(args: argparse.Namespace, name: str, result: Any, table: Callable[[], str],
            plot: Callable[[Path], None] | None = None, document: Any = None) -> int:
    """Write `document` (default: `result`) to `<out>/<name>.json` and the plot to `<out>/<name>.png`; print
    `result` as JSON with --json, else the table. Returns the exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result if document is None else document, indent=2) + "\n")
    if plot is not None:
        plot(out / f"{name}.png")
    print(json.dumps(result) if args.json else table())
    return 0
