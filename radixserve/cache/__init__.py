"""KV memory: the slot allocator, the KV pool tensors and the request→token table.

Nothing here imports the model, the scheduler or the server.
"""

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator"]
