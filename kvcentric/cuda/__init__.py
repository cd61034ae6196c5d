"""The CUDA side of the worker data path (docs/connector.md §CUDA path).

* :mod:`kvcentric.cuda.pinning`: registers the store's host memory with CUDA, so copies
  between HBM and it are DMA at full PCIe speed and the Triton kernels can address it.
* :mod:`kvcentric.cuda.ordering`: a copy stream ordered against the compute stream by
  events: saves wait for a layer's attention, the compute waits for a layer's load.

Importing this package imports torch only; nothing touches CUDA until a GPU worker asks.
"""

from kvcentric.cuda.ordering import CopyOrdering
from kvcentric.cuda.pinning import HostPinner

__all__ = ["CopyOrdering", "HostPinner"]
