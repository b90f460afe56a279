"""Fixtures for service tests: real servers on 127.0.0.1:0 with the tiny family,
and in-process engines over the same weights to compare against."""

from __future__ import annotations

import pytest
import pytest_asyncio

from serving.helpers import channel_to, start_verifier


@pytest_asyncio.fixture
async def verifier(tiny_family):
    """(RunningServer, VerifierService), ready."""
    server, servicer = await start_verifier(tiny_family)
    yield server, servicer
    await server.stop()


@pytest_asyncio.fixture
async def verifier_channel(verifier):
    async with channel_to(verifier[0]) as ch:
        yield ch


@pytest.fixture
def local_verifier(tiny_family):
    """An in-process VerifierEngine over the same target."""
    from specdec.model.loading import ModelSpec
    from verifier.engine import TargetModel, VerifierEngine

    return VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))


@pytest.fixture
def make_local_drafter(tiny_family):
    """kind -> an in-process Drafter over the same weights."""
    from serving.helpers import drafter_builder

    return lambda kind: drafter_builder(tiny_family, kind)()
