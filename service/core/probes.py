"""What the probes answer from (/health, /ready, KServe's live, ready and model ready), as one
value: the engine process builds it from its runtime (`Runtime.probe_state`), and with
`--http-workers` publishes it to the front ends (service/frontends/engine_state.py), which answer
the probes from it themselves. No torch: the front ends import it.

The checks a request makes first (ready, the model's version) are here too, so that a probe and
a request refuse with the same words."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..errors import NotReady, UnknownLayer, no_layer
from ..triton.statistics import VERSION

RETRY_WHILE_LOADING_S = "5"
SHUTTING_DOWN = "shutting down"


@dataclass(frozen=True)
class ProbeState:
    """The engine as the probes see it. `not_live`: why it is not live (None: it is; a front
    end sets it when the engine's heartbeat stops); `not_ready`: what is missing (None: ready);
    `degraded`: ready, but on fewer expert-parallel ranks (why); `draining`: SIGTERM came;
    `models`: the layers served."""

    not_live: str | None = None
    not_ready: str | None = None
    degraded: str | None = None
    draining: bool = False
    models: tuple[str, ...] = ()

    @property
    def ready_reason(self) -> str | None:
        """Why the server is not ready for new requests (None: it is): not live, not ready, or
        draining (a load balancer sends no more once SIGTERM came)."""
        if self.not_live is not None:
            return self.not_live
        if self.not_ready is not None:
            return self.not_ready
        return SHUTTING_DOWN if self.draining else None

    def check_model(self, name: str, version: str = "") -> None:
        """Model `name` (of `version`: empty, any) can serve; else the error a request to it
        gets (503 not ready, 404 unknown)."""
        waiting = self.not_ready if self.not_live is None else self.not_live
        if waiting is not None:
            raise not_ready_error(waiting)
        if name not in self.models:
            raise no_layer(name, self.models)
        check_version(name, version)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ProbeState:
        fields = json.loads(data)
        return cls(**fields | {"models": tuple(fields["models"])})


def not_ready_error(reason: str) -> NotReady:
    return NotReady(f"not ready: {reason}", {"Retry-After": RETRY_WHILE_LOADING_S})


def check_version(name: str, version: str) -> None:
    """`version` is empty (any) or the one version every model has; else a 404."""
    if version not in ("", VERSION):
        raise UnknownLayer(f"model {name!r} has version {VERSION} only, not {version!r}")
