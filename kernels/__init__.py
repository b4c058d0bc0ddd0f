"""streamserve.kernels: the compute ops of the models, each with a pure-torch reference.

`reference` holds the torch implementations (the CPU path and the ground truth of every kernel test).
Triton kernels join them here, op by op, behind the same signatures.
"""

from streamserve.kernels import reference

__all__ = ["reference"]
