"""Run by tests/test_frameworks.py under torchrun on gloo CPU ranks: build each framework's
process groups from the settings ``cptune export --for`` emitted (a JSON file: framework ->
list of settings) with the framework's own code, and print, from rank 0, the ranks each of
its Ulysses and context groups holds, as JSON: {framework: [[ulysses groups, context groups],
...]} in the order of the settings."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist


def diffusers_groups(settings: dict[str, Any]) -> list[list[int]]:
    """The ranks of this rank's (Ulysses, ring) groups as diffusers forms them."""
    from diffusers.models._modeling_parallel import ContextParallelConfig  # what diffusers exports
    from torch.distributed.device_mesh import init_device_mesh

    config = ContextParallelConfig(**settings)
    mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh)
    return [dist.get_process_group_ranks(config._ulysses_mesh.get_group()),
            dist.get_process_group_ranks(config._ring_mesh.get_group())]


def yunchang_groups(settings: dict[str, Any]) -> list[list[int]]:
    """The ranks of this rank's (Ulysses, ring) groups as yunchang forms them."""
    from yunchang import set_seq_parallel_pg
    from yunchang.globals import PROCESS_GROUP

    set_seq_parallel_pg(settings["sp_ulysses_degree"], settings["sp_ring_degree"], dist.get_rank(),
                        dist.get_world_size(), use_ulysses_low=settings["use_ulysses_low"])
    return [dist.get_process_group_ranks(PROCESS_GROUP.ULYSSES_PG),
            dist.get_process_group_ranks(PROCESS_GROUP.RING_PG)]


def main() -> None:
    dist.init_process_group("gloo")
    with open(sys.argv[1]) as file:
        exported = json.load(file)
    build = {"diffusers": diffusers_groups, "yunchang": yunchang_groups}
    mine = {name: [build[name](settings) for settings in all_settings]
            for name, all_settings in exported.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        merged = {}
        for name, all_settings in exported.items():
            merged[name] = [
                [sorted({tuple(rank_view[name][i][k]) for rank_view in everyone}) for k in (0, 1)]
                for i in range(len(all_settings))
            ]
        print(json.dumps(merged))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
