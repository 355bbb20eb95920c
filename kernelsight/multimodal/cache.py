"""vLLM's multimodal processor cache, as its hit counter sees it: an LRU of processed items keyed by content hash,
bounded in bytes (``--mm-processor-cache-gb``, default 4 GiB). An item's size is its processed pixel tensor:
patches x channels x temporal patch x patch^2 float32 values (what Qwen-VL's processor outputs)."""

from __future__ import annotations

from collections import OrderedDict

from kernelsight.simcore.multimodal import MultimodalItem, VisionSpec

DEFAULT_CAPACITY_BYTES = 4 * 2**30


def processed_item_bytes(item: MultimodalItem, vision: VisionSpec) -> int:
    per_patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size * vision.patch_size
    return item.num_patches * per_patch * 4


class ProcessorCache:
    """Hit or miss per item, LRU-evicted by bytes."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def query(self, key: str, size_bytes: int) -> bool:
        """True on a hit (the item becomes most recent); a miss inserts it, evicting the least recent."""
        if key in self._items:
            self._items.move_to_end(key)
            return True
        if size_bytes > self.capacity_bytes:
            return False
        self._items[key] = size_bytes
        self._bytes += size_bytes
        while self._bytes > self.capacity_bytes:
            _, size = self._items.popitem(last=False)
            self._bytes -= size
        return False
