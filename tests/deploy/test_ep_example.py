"""deploy/ep-two-hosts.compose.yml: its settings are valid and its ranks add up."""

from __future__ import annotations

import yaml

from moe_serve.service.settings import Settings
from tests.deploy.files import ROOT

EXAMPLE = ROOT / "deploy" / "ep-two-hosts.compose.yml"


def test_the_two_host_example_names_every_rank_once_with_valid_settings() -> None:
    services = yaml.safe_load(EXAMPLE.read_text())["services"]
    serve = services.pop("serve")["environment"]
    prefix = Settings.model_config["env_prefix"]
    settings = Settings(
        **{k.removeprefix(prefix).lower(): v for k, v in serve.items() if k.startswith(prefix)}
    )
    remote = sorted(s["environment"]["RANK"] for s in services.values())
    assert remote == list(range(settings.ep_local_ranks, settings.ep))
    for service in services.values():
        env = service["environment"]
        assert env["WORLD_SIZE"] == settings.ep
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (
            serve["MASTER_ADDR"],
            serve["MASTER_PORT"],
        )
        assert service["entrypoint"][:2] == ["moe-serve", "ep-rank"]
