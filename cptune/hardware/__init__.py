"""The hardware a measurement or a recommendation is for.

``this_host()`` is the machine cptune runs on, reduced to a fingerprint (``Hardware``); a
``Cluster`` is the nodes a search runs on when they are several (``--hosts``);
``load_description`` reads a topology description of hardware the user does not have (a
shipped name such as "h100-sxm-8", or a TOML file); ``shipped_descriptions`` loads every
shipped one (``cptune hardware``).
"""

from cptune.hardware._cluster import (
    TIERS,
    Cluster,
    ClusterError,
    heads_span_nodes,
    parse_hosts,
    read_hostfile,
    tier_of,
)
from cptune.hardware._description import (
    MAX_RANKS,
    MAX_RANKS_PER_NODE,
    NCCL_PATHS,
    Figure,
    HardwareDescription,
    LinkTier,
)
from cptune.hardware._host import (
    GpuInfo,
    Hardware,
    list_gpus,
    mpi_library,
    tensorrt_version,
    this_gpu_node,
    this_host,
)
from cptune.hardware._loading import (
    HardwareDescriptionError,
    builtin_descriptions,
    load_description,
    shipped_descriptions,
)

__all__ = [
    "Cluster",
    "ClusterError",
    "TIERS",
    "heads_span_nodes",
    "parse_hosts",
    "read_hostfile",
    "tier_of",
    "GpuInfo",
    "Figure",
    "Hardware",
    "HardwareDescription",
    "HardwareDescriptionError",
    "LinkTier",
    "MAX_RANKS",
    "MAX_RANKS_PER_NODE",
    "NCCL_PATHS",
    "builtin_descriptions",
    "list_gpus",
    "load_description",
    "mpi_library",
    "shipped_descriptions",
    "tensorrt_version",
    "this_gpu_node",
    "this_host",
]
