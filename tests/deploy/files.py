"""Where the deployment files are and how to read them: Dockerfile stages, the commented
two-GPU example of docker-compose.yml, env files."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import dockerfile

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "moe-serve.env.example"
SERVING = "moe-serve"  # the compose service that serves
TWO_GPU_BEGIN, TWO_GPU_END = "# --- two-gpu example ---", "# --- end two-gpu example ---"


@dataclass(frozen=True)
class Stage:
    """One `FROM ... [AS name]` stage of the Dockerfile and its instructions, in order."""

    base: str
    name: str | None
    commands: tuple[dockerfile.Command, ...]

    def all(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd]

    def args(self) -> dict[str, str]:
        """`ARG NAME=default` of this stage (and none without a default)."""
        return dict(c.value[0].split("=", 1) for c in self.all("ARG") if "=" in c.value[0])


def parse_stages(path: Path) -> list[Stage]:
    stages: list[Stage] = []
    base, name, commands = "", None, []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            if base:
                stages.append(Stage(base, name, tuple(commands)))
            base = command.value[0]
            name = command.value[2] if len(command.value) == 3 else None
            commands = []
        else:
            commands.append(command)
    stages.append(Stage(base, name, tuple(commands)))
    return stages


def with_two_gpu_example(text: str) -> str:
    """docker-compose.yml with its commented two-GPU services uncommented in place."""
    head, rest = text.split(TWO_GPU_BEGIN, 1)
    block, tail = rest.split(TWO_GPU_END, 1)
    lines = block.splitlines()[1:-1]  # the ends of the two marker lines
    uncommented = "\n".join(re.sub(r"^(\s*)# ?", r"\1", line) for line in lines)
    return f"{head}\n{uncommented}\n{tail.split(chr(10), 1)[1]}"


def env_file_names(path: Path) -> set[str]:
    return {
        line.split("=", 1)[0].strip()
        for line in path.read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }
