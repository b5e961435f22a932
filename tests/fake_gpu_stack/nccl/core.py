"""Stand-in for nccl4py's ``nccl.core`` (tests only): ids and communicators with no NCCL."""

import os


class UniqueId:
    def __init__(self, data: bytes) -> None:
        self.as_bytes = data

    @staticmethod
    def from_bytes(data: bytes) -> "UniqueId":
        return UniqueId(bytes(data))


def get_unique_id() -> UniqueId:
    return UniqueId(os.urandom(128))


class Communicator:
    def __init__(self, nranks: int, rank: int) -> None:
        self.nranks, self.rank, self.ptr = nranks, rank, 0xC0FFEE

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId) -> "Communicator":
        assert isinstance(unique_id, UniqueId) and len(unique_id.as_bytes) == 128
        return cls(nranks, rank)

    def destroy(self) -> None:
        self.ptr = 0
