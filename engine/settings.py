"""What a worker's config class shares: beside its role's own settings, the server's (`server`) and the model's
(`model`) flags, parsed and read back the same way for prefill and decode."""

from __future__ import annotations

import argparse
from typing import Any

from model_runner.loading import add_model_args, model_config
from serving.server import add_server_args, server_config
from serving.settings import add_settings, read_settings, role_of


class WorkerSettings:
    """Mixed into a worker's frozen config dataclass, which has `server` and `model` fields and its own settings."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any:
        return read_settings(cls, args, server=server_config(args), model=model_config(args))

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        add_server_args(parser)
        add_model_args(parser)
        add_settings(parser.add_argument_group(role_of(cls)), cls)
