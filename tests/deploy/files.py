"""Where the deployment files are and how to read them: Dockerfile stages, the commented
two-GPU example of docker-compose.yml, env files."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "moe-serve.env.example"
SERVING = "moe-serve"  # the compose service that serves
TWO_GPU_BEGIN, TWO_GPU_END = "# --- two-gpu example ---", "# --- end two-gpu example ---"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined: `RUN`, `apt-get update && ...`."""

    cmd: str
    value: str

    def words(self) -> list[str]:
        return shlex.split(self.value)

    def exec_form(self) -> list[str]:
        """The JSON array of an ENTRYPOINT/CMD, or of a HEALTHCHECK's CMD."""
        return json.loads(self.value[self.value.index("[") :])


@dataclass(frozen=True)
class Stage:
    """One `FROM ... [AS name]` stage of the Dockerfile and its instructions, in order."""

    base: str
    name: str | None
    instructions: tuple[Instruction, ...]

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]

    def args(self) -> dict[str, str]:
        """`ARG NAME=default` of this stage (and none without a default)."""
        return dict(i.value.split("=", 1) for i in self.all("ARG") if "=" in i.value)

    def env(self) -> dict[str, str]:
        """`ENV K1=V1 K2=V2 ...` of this stage (the key=value form only)."""
        return dict(w.split("=", 1) for i in self.all("ENV") for w in i.words())


def parse_stages(path: Path) -> list[Stage]:
    """The stages in order; instructions before the first FROM (global ARGs) are left out."""
    heads: list[tuple[str, str | None]] = []
    bodies: list[list[Instruction]] = []
    for entry in DockerfileParser(str(path)).structure:
        if entry["instruction"] == "FROM":
            base, _, name = entry["value"].partition(" AS ")
            heads.append((base, name or None))
            bodies.append([])
        elif entry["instruction"] != "COMMENT" and bodies:
            bodies[-1].append(Instruction(entry["instruction"], entry["value"]))
    return [
        Stage(base, name, tuple(body)) for (base, name), body in zip(heads, bodies, strict=True)
    ]


def with_two_gpu_example(text: str) -> str:
    """docker-compose.yml with its commented two-GPU services uncommented in place."""
    head, rest = text.split(TWO_GPU_BEGIN, 1)
    block, tail = rest.split(TWO_GPU_END, 1)
    lines = block.splitlines()[1:-1]  # the ends of the two marker lines
    uncommented = "\n".join(re.sub(r"^(\s*)# ?", r"\1", line) for line in lines)
    return f"{head}\n{uncommented}\n{tail.split(chr(10), 1)[1]}"
