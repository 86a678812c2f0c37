"""Every environment variable the deployment files set is a real setting, valid, and documented
in the deployment guide, docs/deploy.md; every compose-level ${VARIABLE} is documented there
too."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dotenv import dotenv_values
from pydantic import ValidationError

from moe_serve.service.settings import Settings
from tests.deploy.files import ENV_EXAMPLE, Stage, with_two_gpu_example

PREFIX = Settings.model_config["env_prefix"]
VALID_TOKEN = "x" * 32


def compose_environment_names(text: str) -> set[str]:
    """Variables set in any service's `environment:`, the commented two-GPU example included."""
    doc = yaml.safe_load(with_two_gpu_example(text))
    return {name for s in doc["services"].values() for name in s.get("environment", {})}


def image_settings(stages: list[Stage]) -> dict[str, str]:
    """MOE_SERVE_* variables the Dockerfile's final stage sets."""
    return {k: v for k, v in stages[-1].env().items() if k.startswith(PREFIX)}


@pytest.fixture(scope="module")
def deployed_names(compose_text: str, stages: list[Stage]) -> set[str]:
    return (
        compose_environment_names(compose_text)
        | set(dotenv_values(ENV_EXAMPLE))
        | set(image_settings(stages))
    )


def test_every_deployed_variable_is_a_setting(
    deployed_names: set[str], setting_env_names: set[str]
) -> None:
    assert "MOE_SERVE_API_TOKEN" in deployed_names
    assert deployed_names - setting_env_names == set()


def test_every_deployed_variable_is_documented_in_the_deploy_guide(
    deployed_names: set[str], deploy_doc: str
) -> None:
    assert {n for n in deployed_names if f"`{n}`" not in deploy_doc} == set()


def test_compose_interpolation_variables_are_documented(compose_text: str, deploy_doc: str) -> None:
    names = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", compose_text))
    assert names  # the checkpoint directory is one
    assert {n for n in names if f"`{n}`" not in deploy_doc} == set()


@pytest.fixture
def container_env(
    monkeypatch: pytest.MonkeyPatch, serving: dict[str, Any], stages: list[Stage]
) -> dict[str, str]:
    """The serving container's MOE_SERVE_* environment, layered as Docker does: image ENV, then
    the env file (here: the example), then the service's `environment:`."""
    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    env = {**image_settings(stages), **dotenv_values(ENV_EXAMPLE), **serving["environment"]}
    return {name: str(value or "") for name, value in env.items()}


def test_serving_settings_are_valid_once_the_token_is_filled_in(
    monkeypatch: pytest.MonkeyPatch, container_env: dict[str, str], serving: dict[str, Any]
) -> None:
    for name, value in {**container_env, "MOE_SERVE_API_TOKEN": VALID_TOKEN}.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    layers = serving["environment"]["MOE_SERVE_WEIGHTS"].split(",")
    assert settings.weights == tuple(map(Path, layers))
    assert (settings.host, settings.port, settings.device) == ("0.0.0.0", 8000, "cuda")
    assert settings.api_token is not None
    assert settings.api_token.get_secret_value() == VALID_TOKEN


def test_env_example_left_unfilled_refuses_to_start_without_a_token(
    monkeypatch: pytest.MonkeyPatch, container_env: dict[str, str]
) -> None:
    for name, value in container_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match="api_token"):
        Settings()
