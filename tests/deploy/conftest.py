"""The deployment files, parsed once per session, and the settings they configure. No container
engine runs here: these tests read the files, validate them and run what can run outside one."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from moe_serve.service.settings import Settings
from tests.deploy.files import COMPOSE, DOCKERFILE, ROOT, SERVING, Stage, parse_stages


@pytest.fixture(scope="session")
def compose_text() -> str:
    return COMPOSE.read_text()


@pytest.fixture(scope="session")
def compose(compose_text: str) -> dict[str, Any]:
    return yaml.safe_load(compose_text)


@pytest.fixture(scope="session")
def serving(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"][SERVING]


@pytest.fixture(scope="session")
def stages() -> list[Stage]:
    return parse_stages(DOCKERFILE)


@pytest.fixture(scope="session")
def setting_env_names() -> set[str]:
    prefix = Settings.model_config["env_prefix"]
    return {f"{prefix}{name}".upper() for name in Settings.model_fields}


@pytest.fixture(scope="session")
def deploy_doc() -> str:
    """The deployment guide, docs/deploy.md."""
    return (ROOT / "docs" / "deploy.md").read_text()
