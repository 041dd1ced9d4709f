"""aiokafka's private internals are used in one module, for the versions it was checked against.

``infra/aiokafka_internals.py`` is the only place that touches them; these tests fail as
soon as an aiokafka upgrade removes or changes one (an attribute, a method, a parameter,
the version range), so the change shows here instead of as a workaround that silently
stops working.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import aiokafka
import pytest
from aiokafka.conn import ScramAuthenticator
from aiokafka.consumer.fetcher import Fetcher

from infra import aiokafka_internals as internals

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("infra", "scoring_workers", "producers", "shaper", "prm_pipeline")
PRIVATE_NAMES = {
    "_fetcher",
    "_coordinator",
    "_proc_fetch_request",
    "_maybe_leave_group",
    "_fetch_max_wait_ms",
    "force_metadata_update",
    "ScramAuthenticator",
    "create_conn",
    "DefaultRecordBatchBuilder",
}
PRIVATE_MODULES = ("aiokafka.conn", "aiokafka.consumer", "aiokafka.record", "aiokafka.protocol", "aiokafka.client")


def test_the_installed_aiokafka_has_every_internal_we_rely_on() -> None:
    assert internals.problems() == [], "aiokafka changed under infra/aiokafka_internals.py"
    low, high = internals.SUPPORTED
    assert low <= internals.version() < high, f"aiokafka {aiokafka.__version__} is not a checked version"


def test_a_changed_aiokafka_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiokafka, "__version__", "0.15.0")
    monkeypatch.delattr(Fetcher, "_proc_fetch_request")
    found = internals.problems()
    assert any("0.15.0 is outside the checked range" in p for p in found), found
    assert "Fetcher._proc_fetch_request is gone" in found, found


def test_only_the_internals_module_touches_them() -> None:
    offenders: list[str] = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "infra" / "aiokafka_internals.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
                    offenders.append(f"{where}: .{node.attr}")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
                    offenders.append(f"{where}: from {node.module} import ...")
                elif isinstance(node, ast.Import) and any(a.name.startswith(PRIVATE_MODULES) for a in node.names):
                    offenders.append(f"{where}: import {node.names[0].name}")
    assert offenders == [], "aiokafka internals outside infra/aiokafka_internals.py:\n" + "\n".join(offenders)


def test_a_workaround_fails_loudly_when_its_internal_is_gone() -> None:
    not_started = SimpleNamespace()  # no _fetcher: what a consumer of another aiokafka would look like
    with pytest.raises(internals.AiokafkaInternalsChanged, match="has no _fetcher.*test_aiokafka_internals"):
        internals.adapt_fetch_wait(not_started, lambda got: 5)  # type: ignore[arg-type]
    with pytest.raises(internals.AiokafkaInternalsChanged, match="has no _client"):
        asyncio.run(internals.refresh_metadata(not_started))  # type: ignore[arg-type]
    internals.skip_leave_group(not_started)  # type: ignore[arg-type]  # no group: nothing to skip


def test_the_fetch_wait_follows_each_fetch() -> None:
    calls: list[bool] = []

    class FakeFetcher:
        _fetch_max_wait_ms = 20

        async def _proc_fetch_request(self, assignment: object, node_id: int, request: object) -> bool:
            return node_id == 1  # node 1 brings records

    consumer = SimpleNamespace(_fetcher=FakeFetcher())
    internals.adapt_fetch_wait(consumer, lambda got: calls.append(got) or (5 if got else 40))  # type: ignore[arg-type]
    assert asyncio.run(consumer._fetcher._proc_fetch_request(None, 1, None)) is True
    assert internals.fetch_wait_ms(consumer) == 5  # type: ignore[arg-type]
    asyncio.run(consumer._fetcher._proc_fetch_request(None, 2, None))
    assert internals.fetch_wait_ms(consumer) == 40 and calls == [True, False]  # type: ignore[arg-type]


def test_a_scram_refusal_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refused(Exception):
        pass

    installed = ScramAuthenticator.process_server_final_message  # restored after the test
    monkeypatch.setattr(
        ScramAuthenticator, "process_server_final_message", getattr(installed, "__wrapped__", installed)
    )
    internals.explain_scram_errors(lambda mechanism, user, error: Refused(f"{mechanism} {user} {error}"))
    internals.explain_scram_errors(lambda *a: Refused("installed twice"))  # idempotent: the first stays
    auth = ScramAuthenticator.__new__(ScramAuthenticator)
    auth._hashname, auth._sasl_plain_username = "sha512", "svc"
    with pytest.raises(Refused, match="^SCRAM-SHA-512 svc unknown-user$"):
        auth.process_server_final_message("e=unknown-user")


def test_no_metadata_request_asks_the_broker_to_create_a_topic() -> None:
    import aiokafka.admin.client
    import aiokafka.client
    from aiokafka.protocol.metadata import MetadataRequest_v5

    from infra.config import KafkaConfig
    from infra.kafka import common_kwargs

    common_kwargs(KafkaConfig())  # every client of ours is built with these
    for module in (aiokafka.client, aiokafka.admin.client):
        request = module.MetadataRequest(["prm.trajectories"]).build(MetadataRequest_v5)
        assert request.allow_auto_topic_creation is False, module.__name__
    internals.forbid_topic_auto_creation()  # idempotent: no second layer
    assert aiokafka.client.MetadataRequest.__mro__[1].__name__ == "MetadataRequest"
