"""``kvc simulate``: replay a request trace through a model of a pipeline.

No engine runs and no KV byte moves: each request of the trace is a sequence
of block keys, looked up and stored in a model of every node, in arrival
order, one request at a time. The rules are the product's:

* a hit is the longest run of leading blocks present in the serving tier,
  counted from the end of vLLM's own prefix-cache hit (prefix semantics);
* only full blocks are cached, and at least one prompt token is always
  computed, so at most ``(prompt_tokens - 1) // block_size`` blocks are served;
* nodes are asked in ``load_order``; ``first_hit`` serves from the first node
  with a hit, ``longest_hit`` from the one with the most blocks (the first of
  equals), ``ranges`` from each node what it holds after the nodes before it;
  a serving node's blocks are touched (LRU, ARC) as it loads them;
* a request's blocks are stored when it finishes, into vLLM's own cache and
  into every ``save_to`` node, each by its own policy (what it saves, admits
  and promotes: the blocks other nodes loaded into the request).

A model's KV cache groups (:class:`SimKVGroup`, from its ``config.json`` by
:mod:`composer.simulate.shape`) reach every tier model: a hybrid model's tier
stores each layout's blocks on its own (a sliding window only those a hit
needs), in whole trace blocks too: full attention a trace block as one, a
window the blocks of it a hit at a trace block's end needs.

A plugin type brings its own model through ``PluginType.simulator``
(``"module:Class"``, imported here only), built on the code of the real tier
(``offload-cpu``'s model drives the tier's own ``BlockIndex``), so the
prediction cannot drift from the product. Nodes whose type has none are shown
as not modelled and never hit.

Traces and their block keys are :mod:`composer.trace`'s; a run's figures
:mod:`composer.simulate.results`'s; a sweep's runs
:mod:`composer.simulate.sweep`'s; the tables and the sweep's plot
:mod:`composer.simulate.report`'s; bytes per block and KV cache groups from a model's
``config.json`` :mod:`composer.simulate.shape`'s.
"""

from composer.simulate.replay import simulate
from composer.simulate.results import NodeResult, Result, TenantResult
from composer.simulate.tiers import (
    DEFAULT_BLOCK_SIZE,
    VLLM_CACHE_ID,
    PrefixCacheModel,
    SimKVGroup,
    SimRequest,
    SimulateError,
    TierModel,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "VLLM_CACHE_ID",
    "NodeResult",
    "PrefixCacheModel",
    "Result",
    "SimKVGroup",
    "SimRequest",
    "SimulateError",
    "TenantResult",
    "TierModel",
    "simulate",
]
