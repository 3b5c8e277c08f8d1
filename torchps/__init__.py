"""torchps: a gRPC parameter server for PyTorch.

Import from the subpackages: ``torchps.client`` (training code),
``torchps.ps_server`` (the shard daemon), ``torchps.worker`` (the worker CLI).
"""

__version__ = "0.1.0"
