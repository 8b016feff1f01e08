"""``kvc simulate`` of a hybrid model in whole trace blocks, whatever its window.

Full attention moves a trace block (a *unit*) as one entry; a window group keeps
and looks up only the blocks of a unit a hit at a unit's end needs, as *rings*
(:class:`~kvc_offload_cpu.layout.UnitRings`). Here: the rings are those blocks
for windows of 32 to 4096 tokens, the kept rings are the exact tier's kept
blocks that such hits need, the work is the blocks kept (counted, not timed),
and Gemma-2, Gemma-3-1B and Gemma-3-12B shapes replay close to ``--exact``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.layout import GroupLayout, unit_rings
from kvc_offload_cpu.simulate import OffloadCPUModel

from composer.discovery import discover
from composer.simulate import SimKVGroup, simulate
from composer.simulate.shape import model_shape
from composer.trace import TraceRequest, read_trace
from composer.validation import validate_text

CONVERSATION = Path(__file__).parent / "data/traces/mooncake-conversation_trace-500.jsonl"
WINDOWS = [32, 48, 64, 100, 128, 256, 500, 512, 700, 1024, 2048, 4096]
TRACE_BLOCK = 512


def _blocks(rings: Any, picked: Any) -> set[int]:
    """The vLLM blocks of ``picked``: (unit, ring of that unit) pairs."""
    out: set[int] = set()
    for j, i in picked:
        lo, size, _ = rings.rings[j % rings.period][i]
        first = j * rings.unit + lo
        out.update(range(first, first + size))
    return out


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
@pytest.mark.parametrize("block", [16, 32])
def test_rings_are_the_blocks_a_hit_at_a_units_end_needs(kind: str, block: int) -> None:
    """For every hit ``[start, end)`` in units, the rings it asks for are exactly the
    blocks vLLM's rule (GroupLayout.needed) says it needs."""
    unit = TRACE_BLOCK // block
    for window in WINDOWS:
        layout = GroupLayout(kind, block, window)
        rings = unit_rings(layout, unit)
        for end in range(1, 2 * rings.period + 10):
            for start in range(end):
                asked = [
                    (end - back, i)
                    for back, i in rings.needs[end % rings.period]
                    if end - back >= start
                ]
                needed = set(layout.needed(start * unit, end * unit))
                assert _blocks(rings, asked) == needed, (window, start, end)


def test_a_sliding_window_is_at_most_two_rings_a_unit() -> None:
    """A window of n blocks (q units and r blocks): the window's tail (r blocks) and
    the rest of a unit, so a hit at a unit's end asks for both rings of the q units
    before it and the tail of one more."""
    for window in WINDOWS:
        rings = unit_rings(GroupLayout("sliding_window", 32, window), 16)
        q, r = divmod(-(-(window - 1) // 32), 16)
        assert rings.period == 1
        sizes = [size for _, size, _ in rings.rings[0]]
        assert sizes == ([16 - r] if q and r else []) + ([r] if r else [16]), window
        assert len(rings.needs[0]) == (2 * q + 1 if r and q else q or 1), window


@pytest.mark.parametrize("retention", [0, 512, 1024, 2048])
def test_kept_rings_are_the_exact_tiers_blocks_whole_rings(retention: int) -> None:
    """What a save keeps in units: of the blocks the exact tier keeps
    (GroupLayout.kept_blocks), every ring they hold whole; that is every block a hit at
    a retained unit's end needs (a window before a point inside a unit holds its
    rings in part: it serves no such hit), and nothing the exact tier does not keep."""
    block, unit = 32, 16
    for window in WINDOWS:
        layout = GroupLayout("sliding_window", block, window)
        rings = unit_rings(layout, unit)
        lengths = [*range(1, 9 * TRACE_BLOCK, 211)] + [
            TRACE_BLOCK * k + d for k in (1, 2, 5) for d in (-1, 0, 1, 31, 32, 33)
        ]
        for prompt in lengths:
            stop = prompt // TRACE_BLOCK
            ends = (max(0, prompt - 1) // block, prompt // block)
            kept = rings.kept(stop, retention // block, ends)
            got = _blocks(rings, [(j, i) for j, k in enumerate(kept) for i in k])
            exact = layout.kept_blocks(stop * unit, prompt, retention)
            assert got <= exact, (window, prompt)
            whole = [
                (j, i)
                for j in range(stop)
                for i in range(len(rings.rings[j % rings.period]))
                if _blocks(rings, [(j, i)]) <= exact
            ]
            assert got == _blocks(rings, whole), (window, prompt)
            every = retention // block
            points = [h for h in range(unit, (stop + 9) * unit, unit) if every and h % every == 0]
            for h in points + [p for p in ends if p and p % unit == 0]:
                assert set(layout.needed(0, h)) & set(range(stop * unit)) <= got


def _model(window: int, unit: int, retention: int = 512) -> OffloadCPUModel:
    """A 4-layer Gemma-3-like model (three window groups, one full), in units of ``unit``."""
    config = OffloadCPUConfig(capacity=1 << 30, window_retention=retention)
    groups = [SimKVGroup("sliding_window", 8192 * unit, window)] * 3
    groups += [SimKVGroup("attention", 8192 * unit)]
    return OffloadCPUModel(
        config, block_size=32 * unit, bytes_per_block=8192 * unit, groups=groups,
        unit_blocks=unit,
    )


def _counted(model: OffloadCPUModel) -> Counter[str]:
    calls: Counter[str] = Counter()
    for name in ("get", "ready", "allocate", "touch"):
        method = getattr(model.index, name)

        def count(*args: Any, _method: Any = method, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _method(*args, **kw)

        setattr(model.index, name, count)
    return calls


@pytest.mark.parametrize("window", [32, 64, 100, 256, 512])
@pytest.mark.parametrize("units", [4, 16, 64])
def test_a_windows_work_is_the_blocks_it_keeps(window: int, units: int) -> None:
    """A prompt of N trace blocks, saved then looked up and loaded again: with any
    window up to a trace block, N entries of full attention and N rings (one a unit),
    and a lookup asks N units and one ring, whatever the window (block by block:
    16 N entries of full attention, and the window's blocks)."""
    model = _model(window, 16)
    calls = _counted(model)
    keys = [k.to_bytes(8, "little") for k in range(units)]
    prompt = units * TRACE_BLOCK + 100
    model.save(keys, prompt, 0)
    # And one entry of what the window before the prompt's end keeps inside its partial
    # last trace block (its 3 full blocks of 32 tokens): the tier keeps it, no hit needs it.
    assert calls["allocate"] == 2 * units + 1
    n = -(-(window - 1) // 32)
    assert model.index.used_slots == units * (16 + 3 * n) + 3 * min(n, 3)
    calls.clear()
    model.arrive(model.request)
    hit = model.lookup(keys, 0, units)
    model.load(keys, 0, hit)
    assert hit == units
    # The lookup: N units, one ring; the load, group by group: the ring, N units.
    assert calls == {"ready": units + 1 + 3 + units, "touch": 3 + units}


def test_a_units_rings_are_one_entry_where_every_units_end_is_retained() -> None:
    """A 700-token window (22 blocks: a tail of 6 and 10 more): with every trace block's
    end retained (window_retention 512) a tier keeps both rings of a unit or neither,
    so they are one entry; at 1024 they are kept apart, and stay two."""
    keys = [k.to_bytes(8, "little") for k in range(8)]
    for retention, rings in ((512, [(0, 16, 2)]), (1024, [(0, 10, 1), (10, 6, 2)])):
        model = _model(700, 16, retention)
        (window,) = model.rings.values()
        assert list(window.rings[0]) == rings
        model.save(keys, 8 * TRACE_BLOCK, 0)
        assert model.lookup(keys, 0, 8) == 8


@pytest.mark.parametrize(("tail", "served"), [(10, 3 * TRACE_BLOCK), (100, 0)])
def test_a_prompts_end_inside_a_trace_block_keeps_a_window_no_unit_hit_uses(
    tail: int, served: int
) -> None:
    """window_retention 0: a window is kept only where a prompt ends. Ending 10 tokens
    into its fourth trace block, its last full block ends at the third's end: a
    follow-up is served those 3 trace blocks. Ending 100 tokens in, the window kept is
    inside the fourth (the tier keeps it: capacity), and serves no one; as exactly."""
    p = validate_text(
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n"
        "    config: {capacity: 1GiB, window_retention: 0}\n",
        registry=discover(),
    )
    first = TraceRequest(3 * TRACE_BLOCK + tail, 0, (1, 2, 3, 4))
    follow_up = TraceRequest(5 * TRACE_BLOCK, 0, (1, 2, 3, 7, 8))
    groups = [SimKVGroup("sliding_window", 8192, 64), SimKVGroup("attention", 8192)]
    runs = [
        simulate(p, [first, follow_up], bytes_per_block=8192, groups=groups, exact=exact)
        for exact in (False, True)
    ]
    assert [r.tokens_served for r in runs] == [served, served]
    # What each stored: the same, but for the full attention of the fourth trace
    # block's full blocks (units store no partial trace block's).
    saved = [r.nodes[0].blocks_saved for r in runs]
    assert saved[0] == saved[1] - tail // 32, saved


def _shape(tmp_path: Path, config: dict[str, Any], window: int) -> Any:
    path = tmp_path / f"config-{window}.json"
    path.write_text(json.dumps({**config, "sliding_window": window}))
    return model_shape(path, 32)


def _gemma3(layers: int, kv_heads: int, every: int = 6) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": "bfloat16", "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": kv_heads, "head_dim": 256, "hidden_size": 1152,
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(layers)
        ],
    }


#: The three shapes (config.json as published: layers, KV heads of 256, the layer pattern).
SHAPES = {
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "dtype": "bfloat16",
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "hidden_size": 3584,
    },
    "gemma-3-1b": _gemma3(26, 1),
    "gemma-3-12b": _gemma3(48, 8),
}


@pytest.mark.parametrize(
    ("shape", "window", "retention"),
    [
        ("gemma-2-9b", 4096, 512), ("gemma-2-9b", 64, 512), ("gemma-3-1b", 512, 512),
        ("gemma-3-1b", 1024, 0), ("gemma-3-12b", 1024, 1024), ("gemma-3-12b", 64, 512),
        ("gemma-3-12b", 700, 512),
    ],
)
def test_shapes_in_units_are_close_to_exact(
    tmp_path: Path, shape: str, window: int, retention: int
) -> None:
    """On the shipped slice with a tier that evicts: the served fraction and the window
    saving within half a point of ``--exact`` (the whole conversation trace's figures
    are in docs/simulate.md)."""
    kv = _shape(tmp_path, SHAPES[shape], window)
    capacity = kv.bytes_per_block * 4096
    p = validate_text(
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n"
        f"    config: {{capacity: {capacity}, window_retention: {retention}}}\n",
        registry=discover(),
    )
    trace = read_trace(CONVERSATION)
    runs = [
        simulate(p, trace, bytes_per_block=kv.bytes_per_block, groups=kv.groups, exact=exact)
        for exact in (False, True)
    ]
    (units, exact) = runs
    assert units.unit_blocks == 16 and exact.unit_blocks == 1
    assert exact.fraction_served > 0.02 and exact.nodes[0].evictions > 0
    assert units.fraction_served == pytest.approx(exact.fraction_served, abs=0.005)
    assert units.nodes[0].window_saving == pytest.approx(exact.nodes[0].window_saving, abs=0.005)
