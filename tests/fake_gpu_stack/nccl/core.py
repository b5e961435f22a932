"""Stand-in for nccl4py's ``nccl.core`` (tests only): a communicator is an MPI communicator
over the same ranks (the first ``nranks`` of the world at init, as the TensorRT rank makes
them; any split of one), its ``ptr`` a key the stand-in TensorRT finds it by. Like nccl4py,
its first communicator loads NCCL's library (through cuda.pathfinder)."""

import os

from cuda import pathfinder
from mpi4py import MPI

#: Live communicators by ``ptr`` (what a "ncclComm_t" capsule points at).
LIVE: dict[int, "Communicator"] = {}


class UniqueId:
    def __init__(self, data: bytes) -> None:
        self.as_bytes = data

    @staticmethod
    def from_bytes(data: bytes) -> "UniqueId":
        return UniqueId(bytes(data))


def get_unique_id() -> UniqueId:
    return UniqueId(os.urandom(128))


class Communicator:
    def __init__(self, mpi: MPI.Comm) -> None:
        self.mpi = mpi
        self.ptr = id(self)
        LIVE[self.ptr] = self

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId) -> "Communicator":
        assert isinstance(unique_id, UniqueId) and len(unique_id.as_bytes) == 128
        pathfinder.load_nvidia_dynamic_lib("nccl")
        world = MPI.COMM_WORLD
        assert world.Get_rank() == rank < nranks, "the stand-in's communicators start at world rank 0"
        first = world.Get_group().Incl(list(range(nranks)))
        return cls(world.Create_group(first))

    def split(self, color: int | None = None, key: int = 0) -> "Communicator":
        return Communicator(self.mpi.Split(MPI.UNDEFINED if color is None else color, key))

    def destroy(self) -> None:
        LIVE.pop(self.ptr, None)
        self.ptr = 0
