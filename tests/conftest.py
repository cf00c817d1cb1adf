"""Test configuration: Hypothesis profiles and the ``--slow`` switch.

``pytest`` runs the "default" profile (no deadline, failure blobs printed);
``pytest --slow`` runs the "slow" profile (10x the examples) and also the
tests marked ``@pytest.mark.slow``, which are skipped otherwise.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

settings.register_profile("default", deadline=None, print_blob=True)
settings.register_profile(
    "slow",
    settings.get_profile("default"),
    max_examples=10 * settings.get_profile("default").max_examples,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run tests marked slow and use the 'slow' Hypothesis profile (10x examples)",
    )


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile("slow" if config.getoption("--slow") else "default")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
