"""`moe-serve ep-rank`: one expert-parallel rank that joins a `serve --ep N` from another host.

It reads torch.distributed's usual environment: MASTER_ADDR and MASTER_PORT (where rank 0
serves its store), RANK, WORLD_SIZE (= rank 0's --ep) and LOCAL_RANK (its GPU on this host).
Everything else (the layers, their placement, the backend) comes from rank 0; the layer
directories must be at the same paths on every host.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from ...kernels.stages import resolve_device
from .group import Rendezvous, leave
from .worker import run_rank

log = logging.getLogger(__name__)

_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ep-rank",
        description="Join a `moe-serve serve --ep N --ep-local-ranks K` as rank RANK (K <= RANK "
        "< N), reading MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK (the GPU "
        "here, default 0) from the environment. The layers and their placement come from "
        "rank 0; their directories must be at the same paths here. Exits when rank 0 does; "
        "status 2: the environment is incomplete.",
    )
    p.add_argument("--device", default="auto", help="cpu or cuda (default auto); GPU LOCAL_RANK")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    missing = [name for name in _ENVIRONMENT if not os.environ.get(name)]
    if missing:
        logging.basicConfig(format="moe-serve ep-rank: %(message)s")
        log.error("set %s (torch.distributed's environment)", ", ".join(missing))
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(message)s")
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    rv = Rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world)
    run_rank(rank, rv, device)
    leave(0)
