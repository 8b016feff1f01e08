"""A cache policy plugin in one file: first saved, first evicted (a hit changes nothing).

Install it as a package with an entry point in the ``kv_composer`` group, or name
the module in ``KV_COMPOSER_PLUGIN_MODULES``; then ``eviction: fifo`` in a tier's config.
"""

from collections import OrderedDict

from composer import CachePolicy, EvictionPolicy, hookimpl


class Fifo(EvictionPolicy):
    def __init__(self, slots, config=None):
        super().__init__(slots, config)
        self.order = OrderedDict()  # block key -> block, oldest first

    def added(self, block):
        self.order[block.key] = block

    def victims(self):
        return iter(self.order.values())

    def removed(self, block, evicted):
        self.order.pop(block.key, None)


@hookimpl
def register_cache_policies(register):
    register(CachePolicy("fifo", "eviction", Fifo, "first saved, first evicted"))
