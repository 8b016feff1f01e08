"""Shared fixtures: a registry with small test plugin types, and pipeline checkers."""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import pytest
from pipeline_checks import Check, Valid
from pydantic import BaseModel, ByteSize, ConfigDict

from composer import (
    Capabilities,
    PipelineInvalid,
    PluginType,
    Registry,
    ResolvedPipeline,
    discover,
    hookimpl,
    validate_text,
)

_ROOT = Path(__file__).resolve().parent.parent


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A test run stopped with SIGTERM (a CI timeout, a developer's kill) stops as on
# Ctrl-C: pytest tears its fixtures down, so every server a test started (an
# engine, an lmcache server, Valkey, a router) is stopped, not left running.
signal.signal(signal.SIGTERM, _terminated)


@pytest.fixture(scope="session")
def root() -> Path:
    """The repository root."""
    return _ROOT


@pytest.fixture(scope="session")
def kvc() -> str:
    """The venv's ``kvc`` console script: subprocess tests run the installed entry point."""
    path = Path(sys.executable).with_name("kvc")
    assert path.exists(), f"{path} is missing: install the project (make install)"
    return str(path)


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity: ByteSize
    eviction: Literal["lru", "fifo"] = "lru"
    min_blocks: int = 1
    checksums: bool = False


class FakePluginTypes:
    """Plugin types with the capabilities the graph checks combine."""

    @hookimpl
    def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
        register(PluginType(name="cache", node="tests.nowhere:Cache", config=CacheConfig))
        register(
            PluginType(
                name="tracker",
                node="tests.nowhere:Tracker",
                roles=frozenset({"service"}),
                default_role="service",
                capabilities=Capabilities(provides_model=True),
            )
        )
        register(
            PluginType(
                name="blend",
                node="tests.nowhere:Blend",
                capabilities=Capabilities(needs_model=True),
            )
        )


@pytest.fixture(scope="session")
def registry() -> Registry:
    # No entry points: messages listing installed plugins must not depend on the venv.
    return discover(extra=[FakePluginTypes()], entry_points=False)


@pytest.fixture
def problems(registry: Registry) -> Check:
    """``problems(yaml_text, env=...)``: the str() of every problem, asserting there are some."""

    def check(text: str, env: Mapping[str, str] | None = None) -> list[str]:
        with pytest.raises(PipelineInvalid) as info:
            validate_text(textwrap.dedent(text), file="p.yaml", registry=registry, env=env or {})
        return [str(p) for p in info.value.problems]

    return check


@pytest.fixture
def valid(registry: Registry) -> Valid:
    def check(text: str, env: Mapping[str, str] | None = None) -> ResolvedPipeline:
        return validate_text(textwrap.dedent(text), file="p.yaml", registry=registry, env=env or {})

    return check
